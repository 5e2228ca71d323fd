"""kvfs.ep across real processes: dispatch and combine against an oracle.

Each rank dispatches seeded tokens (uneven counts, masked choices), every expert multiplies
what it receives by a known factor, and combine must give each token x times the weighted
sum of its chosen, active experts' factors. Every rank can compute every other rank's data
from the seed, so each checks the layout it received (rows from slot s at s*M, in token
order) and its combined output on its own.
"""

import multiprocessing as mp
import os
import signal

import numpy as np
import pytest

from kvfs import ep, pg

SETTINGS = dict(staging_bytes=64 << 10, inline_bytes_max=4096, op_timeout_ms=30_000)
E, H, K, M = 8, 33, 3, 40
TOKENS = [7, 40, 0, 23]  # per slot: uneven, one rank exactly at M, one with none


def factor(e):
    return (e + 1) / 8.0


def to_bf16(a):
    """float32 -> bfloat16 bits (round to nearest even)."""
    u = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def from_bf16(b):
    return (b.astype(np.uint32) << 16).view(np.float32)


def inputs(seed, slot, dtype):
    rng = np.random.default_rng(seed * 100 + slot)
    t = TOKENS[slot]
    x = (rng.integers(-256, 256, (t, H)) / 32.0).astype(np.float32)
    idx = np.stack([rng.permutation(E)[:K] for _ in range(t)]) if t else np.zeros((0, K), np.int64)
    idx = idx.astype(np.int64)
    idx[rng.random((t, K)) < 0.2] = -1  # masked choices
    w = rng.random((t, K)).astype(np.float32)
    if dtype == "bfloat16":
        return to_bf16(x), idx, w
    return x, idx, w


def rows_f32(x, dtype):
    return from_bf16(x) if dtype == "bfloat16" else x


def check(slot, world, seed, dtype, recv, counts, out, mask, fill=0):
    """Errors found in this rank's results, as strings (empty: all right). ``fill``: what
    the rows nothing landed on hold (0 for a fresh buffer, the caller's for ``out=``)."""
    errs = []
    r = world
    el = E // r
    for le in range(el):
        e = slot * el + le
        n = 0
        for s in range(r):
            if not mask[s]:
                continue
            xs, idx, _ = inputs(seed, s, dtype)
            toks = [t for t in range(len(idx)) if e in idx[t]]
            got = recv[le, s * M:s * M + len(toks)]
            want = xs[toks] if toks else xs[:0]
            if not np.array_equal(got, want):
                errs.append(f"expert {e} rows from slot {s} differ")
            if np.any(recv[le, s * M + len(toks):(s + 1) * M] != fill):
                errs.append(f"expert {e} rows past slot {s}'s tokens are not {fill}")
            n += len(toks)
        if counts[le] != n:
            errs.append(f"expert {e}: count {counts[le]}, want {n}")
    xs, idx, w = inputs(seed, slot, dtype)
    xf = rows_f32(xs, dtype)
    scale = np.zeros(len(idx), np.float32)
    for t in range(len(idx)):
        for j in range(K):
            e = idx[t, j]
            if e >= 0 and mask[e // el]:
                scale[t] += w[t, j] * factor(e)
    want = xf * scale[:, None]
    got = rows_f32(out, dtype)
    tol = dict(rtol=2e-2, atol=2e-2) if dtype == "bfloat16" else dict(rtol=1e-5, atol=1e-5)
    if not np.allclose(got, want, **tol):
        errs.append(f"combine differs by up to {np.abs(got - want).max()}")
    return errs


def experts(recv, slot, world, dtype):
    """Each local expert multiplies its rows by its factor."""
    el = E // world
    f = np.array([factor(slot * el + le) for le in range(el)], np.float32)[:, None, None]
    y = rows_f32(recv, dtype) * f
    return to_bf16(y) if dtype == "bfloat16" else y.astype(np.float32)


def worker(addr, slot, world, out, cases, go=None):
    try:
        g = pg.Group(addr, slot, world, **SETTINGS)
        if go is not None:
            g.barrier()
            out.put((slot, "formed"))
            go.get(timeout=60)
        for seed, dtype, *opts in cases:
            x, idx, w = inputs(seed, slot, dtype)
            mask = np.ones(world, np.int32)
            keep, fill = None, 0
            if "reuse" in opts:
                # A caller-kept receive buffer: rows nothing lands on keep their bytes.
                fill = 77
                keep = np.full((E // world, world * M, H), fill,
                               np.uint16 if dtype == "bfloat16" else np.float32)
            # "carry": the weights travel with the dispatch; the combine takes none.
            carry = "carry" in opts
            recv, counts, h = ep.dispatch(g, x, idx, E, M, active_ranks=mask, dtype=dtype,
                                          out=keep, topk_weights=w if carry else None)
            if keep is not None and recv is not keep:
                raise AssertionError("dispatch did not receive into out=")
            y = experts(recv, slot, world, dtype)
            res = ep.combine(g, y, None if carry else w, h, active_ranks=mask)
            out.put((slot, seed, dtype, list(mask),
                     check(slot, world, seed, dtype, recv, counts, res, mask, fill)))
        g.close()
    except Exception as e:  # noqa: BLE001 - reported to the test
        out.put((slot, "error", repr(e)))


def run(world, cases, kill=None):
    coord = pg.Coordinator(world=world, failure_timeout_ms=2000)
    ctx = mp.get_context("spawn")
    # One queue per process each way: a process killed while it holds a queue's write lock
    # must not wedge the others' results.
    outs = [ctx.Queue() for _ in range(world)]
    gos = [ctx.Queue() for _ in range(world)] if kill is not None else [None] * world
    procs = [ctx.Process(target=worker, args=(coord.addr, s, world, outs[s], cases, gos[s]),
                         daemon=True) for s in range(world)]
    for p in procs:
        p.start()
    live = list(range(world))
    if kill is not None:
        for s in range(world):
            assert outs[s].get(timeout=120)[1] == "formed"
        os.kill(procs[kill].pid, signal.SIGKILL)
        procs[kill].join(10)
        live.remove(kill)
        for s in live:
            gos[s].put("go")
    results = {s: [outs[s].get(timeout=120) for _ in cases] for s in live}
    for p in procs:
        p.join(30)
    return results


def test_dispatch_and_combine_match_the_oracle_for_float32_and_bfloat16():
    world = 4
    cases = [(1, "float32"), (2, "bfloat16"), (3, "float32"), (4, "bfloat16", "reuse"),
             (5, "float32", "reuse", "carry"), (6, "bfloat16", "carry")]
    results = run(world, cases)
    for s, rows in results.items():
        for row in rows:
            assert row[1] != "error", row
            _, seed, dtype, mask, errs = row
            assert mask == [1] * world, (s, seed, mask)
            assert errs == [], (s, seed, dtype, errs)


def test_a_rank_killed_before_dispatch_is_left_out_by_the_survivors():
    world = 4
    results = run(world, [(5, "float32"), (6, "float32")], kill=1)
    for s, rows in results.items():
        for row in rows:
            assert row[1] != "error", row
            _, seed, dtype, mask, errs = row
            assert mask == [1, 0, 1, 1], (s, seed, mask)
            assert errs == [], (s, seed, errs)


def too_many(addr, slot, world, out):
    g = pg.Group(addr, slot, world, **SETTINGS)
    x = np.ones((5 if slot == 0 else 2, H), np.float32)
    idx = np.zeros((len(x), K), np.int64)
    try:
        ep.dispatch(g, x, idx, E, 4)
        out.put((slot, "ok"))
    except pg.PgError as e:
        out.put((slot, e.kind))
    g.close()


def test_too_many_tokens_is_a_typed_error_on_every_rank():
    world = 2
    coord = pg.Coordinator(world=world)
    ctx = mp.get_context("spawn")
    outs = [ctx.Queue() for _ in range(world)]
    procs = [ctx.Process(target=too_many, args=(coord.addr, s, world, outs[s]), daemon=True)
             for s in range(world)]
    for p in procs:
        p.start()
    got = [outs[s].get(timeout=120) for s in range(world)]
    for p in procs:
        p.join(30)
    # The rank over the limit says so; its peer learns it from the exchange at once.
    assert got == [(0, "invalid_argument"), (1, "mismatch")], got


def test_bad_shapes_are_refused_before_any_exchange():
    coord = pg.Coordinator(world=1)
    g = pg.Group(coord.addr, 0, 1, **SETTINGS)
    x = np.ones((3, H), np.float32)
    with pytest.raises(pg.PgError) as e:
        ep.dispatch(g, x, np.zeros((3, K), np.int64) + E, E, M)  # expert out of range
    assert e.value.kind == "invalid_argument"
    with pytest.raises(pg.PgError) as e:
        ep.dispatch(g, x, np.zeros((2, K), np.int64), E, M)  # token counts differ
    assert e.value.kind == "invalid_argument"
    with pytest.raises(pg.PgError) as e:
        ep.dispatch(g, x.astype(np.float16), np.zeros((3, K), np.int64), E, M)
    assert e.value.kind == "invalid_argument"
    recv, counts, h = ep.dispatch(g, x, np.zeros((3, K), np.int64), E, M)
    assert list(counts) == [9] + [0] * (E - 1)  # three choices of expert 0 per token
    with pytest.raises(pg.PgError) as e:
        ep.combine(g, recv[:1], np.ones((3, K), np.float32), h)
    assert e.value.kind == "invalid_argument"
    out = ep.combine(g, recv, np.ones((3, K), np.float32), h)
    assert np.array_equal(out, 3 * x)
    with pytest.raises(pg.PgError) as e:
        ep.combine(g, recv, None, h)  # no weights anywhere
    assert e.value.kind == "invalid_argument"
    w = np.full((3, K), 0.5, np.float32)
    recv, counts, h = ep.dispatch(g, x, np.zeros((3, K), np.int64), E, M, topk_weights=w)
    with pytest.raises(pg.PgError) as e:
        ep.combine(g, recv, np.ones((3, K), np.float32), h)  # not the dispatched weights
    assert e.value.kind == "invalid_argument"
    assert np.array_equal(ep.combine(g, recv, None, h), 1.5 * x)
    assert np.array_equal(ep.combine(g, recv, w, h), 1.5 * x)
    g.close()


def one_case(g, slot, world, seed, dtype):
    x, idx, w = inputs(seed, slot, dtype)
    mask = np.ones(world, np.int32)
    recv, counts, h = ep.dispatch(g, x, idx, E, M, active_ranks=mask, dtype=dtype)
    res = ep.combine(g, experts(recv, slot, world, dtype), w, h, active_ranks=mask)
    return list(mask), check(slot, world, seed, dtype, recv, counts, res, mask)


def survivor_then_rejoin(addr, slot, world, out, go):
    try:
        g = pg.Group(addr, slot, world, **SETTINGS)
        g.barrier()
        out.put("formed")
        go.get(timeout=60)
        out.put(one_case(g, slot, world, 7, "float32"))
        go.get(timeout=60)
        import time
        deadline = time.monotonic() + 60
        while g.waiting_slots() != [1] and time.monotonic() < deadline:
            time.sleep(0.05)
        g.change(activate=[1])
        out.put(one_case(g, slot, world, 8, "bfloat16"))
        g.close()
    except Exception as e:  # noqa: BLE001 - reported to the test
        out.put(("error", repr(e)))


def replacement(addr, slot, world, out):
    try:
        g = pg.Group(addr, slot, world, **SETTINGS)  # returns once the survivors activate it
        out.put(one_case(g, slot, world, 8, "bfloat16"))
        g.close()
    except Exception as e:  # noqa: BLE001 - reported to the test
        out.put(("error", repr(e)))


def test_a_replacement_takes_part_again_once_the_survivors_activate_it():
    world = 4
    coord = pg.Coordinator(world=world, failure_timeout_ms=2000)
    ctx = mp.get_context("spawn")
    outs = [ctx.Queue() for _ in range(world)]
    gos = [ctx.Queue() for _ in range(world)]
    procs = [ctx.Process(target=survivor_then_rejoin, args=(coord.addr, s, world, outs[s], gos[s]),
                         daemon=True) for s in range(world)]
    for p in procs:
        p.start()
    assert [outs[s].get(timeout=120) for s in range(world)] == ["formed"] * world
    os.kill(procs[1].pid, signal.SIGKILL)
    procs[1].join(10)
    live = [0, 2, 3]
    for s in live:
        gos[s].put("go")
    for s in live:
        assert outs[s].get(timeout=120) == ([1, 0, 1, 1], []), s
    outs[1] = ctx.Queue()
    rep = ctx.Process(target=replacement, args=(coord.addr, 1, world, outs[1]), daemon=True)
    rep.start()
    for s in live:
        gos[s].put("go")
    for s in range(world):
        assert outs[s].get(timeout=120) == ([1, 1, 1, 1], []), s
    for p in procs + [rep]:
        p.join(30)
