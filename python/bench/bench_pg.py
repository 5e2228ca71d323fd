"""kvfs-pg against torch's gloo, same process layout, same run.

Each backend runs as N processes (torch.multiprocessing, spawn) doing the same
torch.distributed calls on CPU tensors: allreduce (sum, float32), allgather, alltoall and
broadcast, sizes from 4 KiB up. Rank 0 times every call; the figures are p50/p99 latency and
algbw/busbw from the p50 (nccl-tests definitions: busbw = algbw x 2(n-1)/n for allreduce,
(n-1)/n for allgather and alltoall, 1 for broadcast). The machine's limits are measured in the
same run: memcpy (numpy copy) and raw loopback TCP between two processes.

    python python/bench/bench_pg.py --procs 2,4 --sizes 4K,1M,64M
"""

import argparse
import os
import socket
import statistics
import sys
import time

import numpy as np

SIZES = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def parse_size(s):
    s = s.strip().upper()
    return int(s[:-1]) * SIZES[s[-1]] if s[-1] in SIZES else int(s)


def fmt_size(n):
    for u in ("G", "M", "K"):
        if n >= SIZES[u] and n % SIZES[u] == 0:
            return f"{n // SIZES[u]}{u}"
    return str(n)


BUS = {"allreduce": lambda n: 2 * (n - 1) / n, "allgather": lambda n: (n - 1) / n,
       "alltoall": lambda n: (n - 1) / n, "broadcast": lambda n: 1.0}


def iters_for(size):
    # At least 15 calls even at 256 MiB: on a shared 2-core machine a p50 of 5 swings by 30%.
    return max(15, min(200, (256 << 20) // max(size, 1) // 4))


def worker(rank, nprocs, backend, port, ops, sizes, out):
    import torch
    import torch.distributed as dist

    if backend == "kvfs":
        import kvfs.pg  # noqa: F401  registers the backend
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group(backend, rank=rank, world_size=nprocs)
    res = {}
    for op in ops:
        for size in sizes:
            n = size // 4
            if op == "allreduce":
                t = torch.ones(n, dtype=torch.float32)
                call = lambda: dist.all_reduce(t)  # noqa: E731
            elif op == "broadcast":
                t = torch.ones(n, dtype=torch.float32)
                call = lambda: dist.broadcast(t, 0)  # noqa: E731
            elif op == "allgather":
                # size is the output (n_ranks blocks), as nccl-tests count it
                t = torch.ones(max(n // nprocs, 1), dtype=torch.float32)
                o = torch.empty(t.numel() * nprocs, dtype=torch.float32)
                call = lambda: dist.all_gather_into_tensor(o, t)  # noqa: E731
            else:
                m = max(n // nprocs, 1) * nprocs
                t = torch.ones(m, dtype=torch.float32)
                o = torch.empty(m, dtype=torch.float32)
                call = lambda: dist.all_to_all_single(o, t)  # noqa: E731
            for _ in range(3):
                call()
            dist.barrier()
            lat = []
            for _ in range(iters_for(size)):
                t0 = time.perf_counter()
                call()
                lat.append(time.perf_counter() - t0)
            dist.barrier()
            res[(op, size)] = lat
    if rank == 0:
        out.put(res)
    dist.barrier()
    dist.destroy_process_group()


def run_backend(backend, nprocs, ops, sizes):
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [ctx.Process(target=worker, args=(r, nprocs, backend, port, ops, sizes, q))
             for r in range(nprocs)]
    for p in procs:
        p.start()
    res = q.get(timeout=1800)
    for p in procs:
        p.join(120)
    return res


def wheel_profile():
    """The kvfs wheel's build profile; a debug build's figures are not kvfs's (said on stderr)."""
    import kvfs._native
    profile = getattr(kvfs._native, "BUILD_PROFILE", "unknown")
    if profile != "release":
        print(f"warning: the kvfs wheel is not a release build ({profile}): its figures are "
              "not kvfs's "
              "(install a release wheel: pip install ./python)", file=sys.stderr)
    return profile


def memcpy_gbps(size=64 << 20):
    a = np.ones(size, dtype=np.uint8)
    b = np.empty_like(a)
    np.copyto(b, a)
    best = min(_timed(lambda: np.copyto(b, a)) for _ in range(10))
    return size / best / 1e9


def _timed(f):
    t = time.perf_counter()
    f()
    return time.perf_counter() - t


def _tcp_sink(port, total):
    with socket.create_connection(("127.0.0.1", port)) as c:
        buf = bytearray(1 << 20)
        got = 0
        while got < total:
            n = c.recv_into(buf)
            if n == 0:
                break
            got += n
        c.sendall(b"k")


def tcp_gbps(total=512 << 20):
    import multiprocessing as mp

    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    port = srv.getsockname()[1]
    p = mp.get_context("spawn").Process(target=_tcp_sink, args=(port, total))
    p.start()
    c, _ = srv.accept()
    chunk = b"x" * (1 << 20)
    t = time.perf_counter()
    sent = 0
    while sent < total:
        c.sendall(chunk)
        sent += len(chunk)
    c.recv(1)
    el = time.perf_counter() - t
    p.join()
    c.close()
    srv.close()
    return total / el / 1e9


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--procs", default="2,4,8")
    ap.add_argument("--sizes", default="4K,64K,1M,16M,64M,256M")
    ap.add_argument("--ops", default="allreduce,allgather,alltoall,broadcast")
    ap.add_argument("--backends", default="kvfs,gloo")
    a = ap.parse_args()
    procs = [int(x) for x in a.procs.split(",")]
    sizes = [parse_size(x) for x in a.sizes.split(",")]
    ops = a.ops.split(",")
    backends = a.backends.split(",")
    mem, tcp = memcpy_gbps(), tcp_gbps()
    print(f"machine: memcpy {mem:.2f} GB/s, raw loopback tcp {tcp:.2f} GB/s (same run); "
          f"kvfs wheel: {wheel_profile()}")
    print(f"{'op':<10}{'n':>3}{'size':>7} | " + " | ".join(
        f"{b:>5} p50 us  p99 us busbw GB/s  /tcp /mcpy" for b in backends) + " | busbw kvfs/gloo  p50 gloo/kvfs")
    for n in procs:
        results = {b: run_backend(b, n, ops, sizes) for b in backends}
        for op in ops:
            for size in sizes:
                cols, bw, p50 = [], {}, {}
                for b in backends:
                    lat = sorted(results[b][(op, size)])
                    p = statistics.median(lat)
                    p99 = lat[min(len(lat) - 1, int(round(0.99 * (len(lat) - 1))))]
                    algbw = size / p / 1e9
                    busbw = algbw * BUS[op](n)
                    bw[b], p50[b] = busbw, p
                    cols.append(f"{p * 1e6:>11.1f} {p99 * 1e6:>7.1f} {busbw:>10.3f} {busbw / tcp:>5.2f} {busbw / mem:>5.2f}")
                tail = ""
                if "kvfs" in bw and "gloo" in bw:
                    tail = f" | {bw['kvfs'] / bw['gloo']:>15.2f} {p50['gloo'] / p50['kvfs']:>12.2f}"
                print(f"{op:<10}{n:>3}{fmt_size(size):>7} | " + " | ".join(cols) + tail)
        sys.stdout.flush()


if __name__ == "__main__":
    main()
