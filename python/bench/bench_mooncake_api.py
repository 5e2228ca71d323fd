#!/usr/bin/env python3
"""Benchmark of the reference store API on kvfs, against the machine's own limits.

The calls are the ones a reference (Mooncake) user makes: bytes ``put``/``get`` and the
zero-copy ``batch_put_from``/``batch_get_into`` into registered numpy buffers, for objects of
64 KiB to 64 MiB. Two processes hold the two ends: this one is the store client
(``global_segment_size=0``), and a ``kvfs node`` process holds the data (plus a ``kvfs master``
process for metadata).

The Transfer Engine calls a P/D connector makes (``mooncake.engine.TransferEngine``
``batch_transfer_sync_write``/``read``) run between this process and a second Python process
holding a registered numpy buffer: transport ``tcp`` is memory registered by address (what
vLLM registers: its KV cache), ``shm`` is managed buffers (``allocate_managed_buffer``) on both
sides; each batch moves ``--batch-bytes`` in items of the given size. The ``tcp`` zero-copy batch
figures (store ``batch_put_from``/``batch_get_into`` and the Transfer Engine's) pair every round with a raw TCP sample of the same bytes taken just before it (a sink
process that stays up, the better of one and four streams) and report the median of the
rounds' ratios, as ``kvfs bench tiers`` interleaves its rounds; their ratio to the suite limit
is the last column, marked ``*`` (``ratio_suite`` in JSON).

Limits measured in the same run:
* raw loopback TCP: plain Python sockets between this process and a child process, one stream
  and four (threads), the better of the two, measured before and after the kvfs figures (the
  machine is shared: the mean of the two is the limit, and both are printed); every ``tcp``
  figure is a ratio of it;
* single-thread memcpy (numpy ``copyto`` of 256 MiB): the limit of a same-host copy; ``shm``
  figures (kvfs picks shared memory between processes on one host) print their ratio to it,
  and to raw TCP too.

Usage::

    python python/bench/bench_mooncake_api.py                  # table
    python python/bench/bench_mooncake_api.py --json           # one JSON object per figure
    python python/bench/bench_mooncake_api.py --sizes 64K,1M --transports tcp --min-s 0.5

The ``kvfs`` binary comes from ``--kvfs-bin``, ``$KVFS_BIN`` or
``$CARGO_TARGET_DIR/{release,debug}/kvfs``. Absolute figures on a shared machine are noise;
the ratios are the figures.
"""

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

import numpy as np

from kvfs.mooncake import MooncakeDistributedStore

UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def parse_size(s):
    s = s.strip().upper().rstrip("B").rstrip("I")
    return int(s[:-1]) * UNITS[s[-1]] if s[-1] in UNITS else int(s)


def human(n):
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale and n % scale == 0:
            return f"{n // scale} {unit}"
    return f"{n} B"


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def kvfs_bin(explicit):
    if explicit:
        return explicit
    if os.environ.get("KVFS_BIN"):
        return os.environ["KVFS_BIN"]
    target = os.environ.get("CARGO_TARGET_DIR", "/var/tmp/kvfs-target")
    for profile in ("release", "debug"):
        p = os.path.join(target, profile, "kvfs")
        if os.access(p, os.X_OK):
            return p
    sys.exit(f"no kvfs binary under {target}: cargo build --release --bin kvfs, or --kvfs-bin")


# ----- limits --------------------------------------------------------------------------------

def raw_tcp_gbps(total_bytes, streams):
    """Plain Python sockets, this process sending to a child process over loopback."""
    sink = PairedTcp(total_bytes)
    try:
        return sink.send_streams(streams)
    finally:
        sink.close()


def memcpy_gbps(nbytes=256 << 20, rounds=3):
    a = np.ones(nbytes, dtype=np.uint8)
    b = np.empty_like(a)
    np.copyto(b, a)  # fault the pages in
    best = 0.0
    for _ in range(rounds):
        t0 = time.perf_counter()
        np.copyto(b, a)
        best = max(best, nbytes / (time.perf_counter() - t0) / 1e9)
    return best


# ----- the cluster ---------------------------------------------------------------------------


class Cluster:
    def __init__(self, binary, node_bytes, tmp):
        self.port, self.admin = free_port(), free_port()
        self.master = f"127.0.0.1:{self.port}"
        log = open(os.path.join(tmp, "kvfs.log"), "wb")
        self.procs = [
            subprocess.Popen(
                [binary, "master", f"--rpc_port={self.port}", "--rpc_address=127.0.0.1",
                 f"--metrics_port={self.admin}", "--metrics_host=127.0.0.1"],
                stdout=log, stderr=subprocess.STDOUT,
            )
        ]
        self._wait(lambda: b"ok" in self._get("/health"))
        self.procs.append(
            subprocess.Popen(
                [binary, "--master", self.master, "node", "--dram", str(node_bytes)],
                stdout=log, stderr=subprocess.STDOUT,
            )
        )
        self._wait(lambda: json.loads(self._get("/get_all_segments")))

    def _get(self, path):
        with urllib.request.urlopen(f"http://127.0.0.1:{self.admin}{path}", timeout=2) as r:
            return r.read()

    @staticmethod
    def _wait(pred, timeout=30):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                if pred():
                    return
            except OSError:
                pass
            time.sleep(0.05)
        raise TimeoutError("the kvfs cluster did not start")

    def stop(self):
        for p in reversed(self.procs):
            p.terminate()
        for p in self.procs:
            p.wait(timeout=10)


# ----- measurements --------------------------------------------------------------------------


def check(rc, what):
    bad = [r for r in (rc if isinstance(rc, list) else [rc]) if r < 0]
    if bad:
        raise RuntimeError(f"{what} failed with code {bad[0]}")


def timed(fn, min_s, rounds_min=3, before=None):
    """Runs fn() until min_s has passed (and at least rounds_min times); returns the
    per-round durations. ``before`` runs untimed ahead of each round."""
    times = []
    start = time.perf_counter()
    while len(times) < rounds_min or time.perf_counter() - start < min_s:
        if before:
            before()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return times


def figure(op, transport, size, nbytes_per_round, ops_per_round, times, limit, limit_gbps):
    total = sum(times)
    gbps = nbytes_per_round * len(times) / total / 1e9
    per_op = sorted(t / ops_per_round for t in times)
    p99 = per_op[min(len(per_op) - 1, int(len(per_op) * 0.99))]
    return {
        "bench": "python",
        "case": f"mooncake api {op}",
        "transport": transport,
        "op": op,
        "size_bytes": size,
        "gbps": round(gbps, 3),
        "ops_per_s": round(ops_per_round * len(times) / total, 1),
        "p50_us": round(statistics.median(per_op) * 1e6, 1),
        "p99_us": round(p99 * 1e6, 1),
        "limit": limit,
        "limit_gbps": round(limit_gbps, 3),
        "ratio": round(gbps / limit_gbps, 3),
    }


def run_transport(cluster, transport, sizes, args, limits, emit):
    os.environ["KVFS_TRANSPORT"] = transport
    store = MooncakeDistributedStore()
    rc = store.setup("localhost", "P2PHANDSHAKE", 0, args.batch_bytes * 2, "tcp", "", cluster.master)
    check(rc, "setup")
    limit, limit_gbps = limits[transport]
    # The zero-copy batches over tcp pair every round with a raw TCP sample (PairedTcp).
    pair = PairedTcp(args.batch_bytes) if transport == "tcp" else None
    src = np.random.default_rng(1).integers(0, 255, args.batch_bytes, dtype=np.uint8)
    dst = np.ones_like(src)  # touched: no first-use page faults inside the figures
    check(store.register_buffer(src.ctypes.data, src.nbytes), "register_buffer")
    check(store.register_buffer(dst.ctypes.data, dst.nbytes), "register_buffer")
    seq = [0]

    def fresh_keys(n, size):
        seq[0] += 1
        return [f"bench/{transport}/{size}/{seq[0]}/{i}" for i in range(n)]

    def clear():
        store.remove_all(force=True)

    try:
        for size in sizes:
            n = max(1, args.batch_bytes // size)
            ptrs = [src.ctypes.data + i * size for i in range(n)]
            dptrs = [dst.ctypes.data + i * size for i in range(n)]
            value = src[:size].tobytes()

            # bytes put: one object per call, new keys each round (a put of an existing key is
            # a no-op under first-writer-wins and would measure nothing).
            per_round = max(1, min(n, (64 << 20) // size))
            state = {}

            def prep_put():
                clear()
                state["keys"] = fresh_keys(per_round, size)

            def put_round():
                for k in state["keys"]:
                    check(store.put(k, value), "put")

            t = timed(put_round, args.min_s, before=prep_put)
            emit(figure("put", transport, size, per_round * size, per_round, t, limit, limit_gbps))

            # bytes get of objects put once.
            clear()
            keys = fresh_keys(per_round, size)
            for k in keys:
                check(store.put(k, value), "put")

            def get_round():
                for k in keys:
                    if len(store.get(k)) != size:
                        raise RuntimeError("get returned a short value")

            t = timed(get_round, args.min_s)
            emit(figure("get", transport, size, per_round * size, per_round, t, limit, limit_gbps))

            # zero-copy batch put from the registered buffer, fresh keys each round.
            def prep_batch():
                clear()
                state["keys"] = fresh_keys(n, size)

            def put_batch_round():
                check(store.batch_put_from(state["keys"], ptrs, [size] * n), "batch_put_from")

            if pair is not None:
                emit(paired_figure("batch_put_from", size, n * size, n, put_batch_round, pair,
                                   args.min_s, before=prep_batch))
            else:
                t = timed(put_batch_round, args.min_s, before=prep_batch)
                emit(figure("batch_put_from", transport, size, n * size, n, t, limit, limit_gbps))

            # zero-copy batch get into the registered buffer.
            keys = state["keys"]

            def get_batch_round():
                check(store.batch_get_into(keys, dptrs, [size] * n), "batch_get_into")

            if pair is not None:
                fig = paired_figure("batch_get_into", size, n * size, n, get_batch_round, pair,
                                    args.min_s)
            else:
                t = timed(get_batch_round, args.min_s)
                fig = figure("batch_get_into", transport, size, n * size, n, t, limit, limit_gbps)
            if not np.array_equal(src[: n * size], dst[: n * size]):
                raise RuntimeError("batch_get_into read wrong bytes")
            emit(fig)
            clear()
    finally:
        if pair is not None:
            pair.close()
        store.unregister_buffer(src.ctypes.data)
        store.unregister_buffer(dst.ctypes.data)
        store.close()


_TE_TARGET = r"""
import json, sys
import numpy as np
from mooncake.engine import TransferEngine
size, managed = int(sys.argv[1]), sys.argv[2] == "managed"
te = TransferEngine()
assert te.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
if managed:
    addr = te.allocate_managed_buffer(size)
else:
    buf = np.ones(size, dtype=np.uint8)
    addr = buf.ctypes.data
    assert te.register_memory(addr, size) == 0
print(json.dumps({"name": f"127.0.0.1:{te.get_rpc_port()}", "addr": addr}), flush=True)
sys.stdin.read()
"""


# Each side of a raw stream cycles through FOOTPRINT bytes (twice this machine's 32 MiB L3), so
# the limit moves bytes between memory as an object's transfer does; the sink's buffers are
# faulted in once, at start, and reused by every connection.
FOOTPRINT = 64 << 20
PIECE = 4 << 20

_PAIR_SINK = r"""
import queue, socket, sys, threading
FOOTPRINT, PIECE = %d, %d
spare = queue.Queue()
for _ in range(4):
    spare.put(bytearray(b"\x01") * FOOTPRINT)
srv = socket.socket(); srv.bind(("127.0.0.1", 0)); srv.listen(64)
print(srv.getsockname()[1], flush=True)
def drain(c):
    try:
        buf = spare.get_nowait()
    except queue.Empty:
        buf = bytearray(b"\x01") * FOOTPRINT
    view, off = memoryview(buf), 0
    left = int.from_bytes(c.recv(8, socket.MSG_WAITALL), "little")
    while left > 0:
        if off + PIECE > FOOTPRINT: off = 0
        n = c.recv_into(view[off:off + PIECE], min(PIECE, left))
        if n == 0: break
        left -= n; off += n
    spare.put(buf)
    c.sendall(b"k"); c.close()
while True:
    c, _ = srv.accept(); threading.Thread(target=drain, args=(c,), daemon=True).start()
""" % (FOOTPRINT, PIECE)


class PairedTcp:
    """Raw loopback TCP samples taken between the rounds of a figure (a sink process that
    stays up), so each round's ratio compares it with the limit measured next to it: on a
    shared machine the limit drifts by a third within one run."""

    def __init__(self, nbytes):
        self.nbytes = nbytes
        self.child = subprocess.Popen([sys.executable, "-c", _PAIR_SINK], stdout=subprocess.PIPE,
                                      text=True)
        self.port = int(self.child.stdout.readline())
        self.payload = memoryview(np.random.default_rng(0).integers(0, 255, FOOTPRINT,
                                                                    dtype=np.uint8))

    def send_streams(self, streams):
        """GB/s of sending ``nbytes`` to the sink over ``streams`` connections at once."""
        per = self.nbytes // streams
        socks = [socket.create_connection(("127.0.0.1", self.port)) for _ in range(streams)]

        def send(s, first):
            s.sendall(per.to_bytes(8, "little"))
            left, off = per, first
            while left > 0:
                if off + PIECE > FOOTPRINT:
                    off = 0
                n = min(PIECE, left)
                s.sendall(self.payload[off:off + n])
                left -= n
                off += n
            s.recv(1)

        # The streams start at different offsets: none reads what another just brought in.
        t0 = time.perf_counter()
        ts = [threading.Thread(target=send, args=(s, (i * FOOTPRINT // streams) // PIECE * PIECE))
              for i, s in enumerate(socks)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        dt = time.perf_counter() - t0
        for s in socks:
            s.close()
        return per * streams / dt / 1e9

    def sample(self):
        """The better of one stream and four, as the suite limit takes it."""
        return max(self.send_streams(1), self.send_streams(4))

    def close(self):
        self.child.kill()
        self.child.wait(timeout=10)


def paired_figure(op, size, nbytes, ops, fn, pair, min_s, before=None):
    """Rounds of (limit sample, timed fn) until min_s; the ratio is the median of the rounds'
    ratios, the limit the median sample. ``before`` runs untimed ahead of each round."""
    times, limits, ratios = [], [], []
    start = time.perf_counter()
    while len(times) < 5 or time.perf_counter() - start < min_s:
        if before:
            before()
        lim = pair.sample()
        t0 = time.perf_counter()
        fn()
        dt = time.perf_counter() - t0
        times.append(dt)
        limits.append(lim)
        ratios.append(nbytes / dt / 1e9 / lim)
    fig = figure(op, "tcp", size, nbytes, ops, times, "tcp", statistics.median(limits))
    fig["ratio"] = round(statistics.median(ratios), 3)
    fig["limit_paired"] = True
    return fig


def run_te(transport, sizes, args, emit, limit, limit_gbps):
    """TransferEngine batch writes and reads between this process and a target process."""
    from mooncake.engine import TransferEngine

    managed = transport == "shm"
    size_all = args.batch_bytes
    # tcp figures pair every round with a raw TCP sample of the same bytes (PairedTcp).
    pair = PairedTcp(size_all) if transport == "tcp" else None
    child = subprocess.Popen(
        [sys.executable, "-c", _TE_TARGET, str(size_all), "managed" if managed else "raw"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )
    try:
        info = json.loads(child.stdout.readline())
        te = TransferEngine()
        check(te.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", ""), "te initialize")
        if managed:
            src = te.allocate_managed_buffer(size_all)
            dst = te.allocate_managed_buffer(size_all)
            pattern = np.random.default_rng(2).integers(0, 255, size_all, dtype=np.uint8).tobytes()
            check(te.write_bytes_to_buffer(src, pattern, size_all), "write_bytes_to_buffer")
            te.write_bytes_to_buffer(dst, b"\1" * size_all, size_all)
        else:
            a = np.random.default_rng(2).integers(0, 255, size_all, dtype=np.uint8)
            b = np.ones_like(a)
            src, dst = a.ctypes.data, b.ctypes.data
            check(te.register_memory(src, size_all), "te register_memory")
            check(te.register_memory(dst, size_all), "te register_memory")
        for size in sizes:
            n = max(1, size_all // size)
            offs = [i * size for i in range(n)]
            peer = [info["addr"] + o for o in offs]
            lens = [size] * n

            def write():
                check(te.batch_transfer_sync_write(info["name"], [src + o for o in offs], peer, lens), "te write")

            def read():
                check(te.batch_transfer_sync_read(info["name"], [dst + o for o in offs], peer, lens), "te read")

            for op, fn in (("te_batch_write", write), ("te_batch_read", read)):
                if pair is not None:
                    emit(paired_figure(op, size, n * size, n, fn, pair, args.min_s))
                else:
                    t = timed(fn, args.min_s)
                    emit(figure(op, transport, size, n * size, n, t, limit, limit_gbps))
            got = te.read_bytes_from_buffer(dst, n * size) if managed else b[: n * size].tobytes()
            want = te.read_bytes_from_buffer(src, n * size) if managed else a[: n * size].tobytes()
            if got != want:
                raise RuntimeError("TransferEngine read back wrong bytes")
    finally:
        if pair is not None:
            pair.close()
        child.stdin.close()
        child.wait(timeout=30)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="64K,1M,16M,64M", help="object sizes (K/M/G binary)")
    ap.add_argument("--transports", default="tcp,shm", help="tcp (forced), shm (kvfs's choice)")
    ap.add_argument("--min-s", type=float, default=1.0, help="minimum seconds per figure")
    ap.add_argument("--batch-bytes", default="128M", help="bytes per zero-copy batch")
    ap.add_argument("--limit-bytes", default="1G", help="bytes sent to measure raw TCP")
    ap.add_argument("--node-bytes", default="1G", help="DRAM of the node process")
    ap.add_argument("--json", action="store_true", help="one JSON object per figure")
    ap.add_argument("--kvfs-bin", default=None)
    ap.add_argument("--no-te", action="store_true", help="skip the TransferEngine figures")
    ap.add_argument("--no-store", action="store_true", help="skip the store figures")
    args = ap.parse_args()
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    args.batch_bytes = max(parse_size(args.batch_bytes), max(sizes))
    transports = [t.strip() for t in args.transports.split(",") if t.strip()]

    limit_bytes = parse_size(args.limit_bytes)

    def tcp_limits():
        return raw_tcp_gbps(limit_bytes, 1), raw_tcp_gbps(limit_bytes, 4)

    one, four = tcp_limits()
    copy_limit = memcpy_gbps()
    rows = []

    with tempfile.TemporaryDirectory() as tmp:
        cluster = Cluster(kvfs_bin(args.kvfs_bin), parse_size(args.node_bytes), tmp)
        try:
            limits = {"tcp": ("tcp", 1.0), "shm": ("memcpy", copy_limit)}
            for t in transports:
                if not args.no_store:
                    run_transport(cluster, t, sizes, args, limits, rows.append)
                if not args.no_te:
                    run_te(t, sizes, args, rows.append, *limits[t])
        finally:
            cluster.stop()
    one_after, four_after = tcp_limits()
    tcp_limit = (max(one, four) + max(one_after, four_after)) / 2
    for fig in rows:
        if fig.get("limit_paired"):
            fig["ratio_suite"] = round(fig["gbps"] / tcp_limit, 3)
        elif fig["transport"] == "tcp":
            fig["limit_gbps"] = round(tcp_limit, 3)
            fig["ratio"] = round(fig["gbps"] / tcp_limit, 3)
        else:
            fig["ratio_tcp"] = round(fig["gbps"] / tcp_limit, 3)

    if args.json:
        for when, g1, g4 in (("before", one, four), ("after", one_after, four_after)):
            for g, streams in ((g1, 1), (g4, 4)):
                print(json.dumps({"bench": "python", "case": f"raw loopback tcp, {streams} stream(s), {when}",
                                  "transport": "tcp", "op": "limit", "size_bytes": None, "gbps": round(g, 3),
                                  "ops_per_s": None, "p50_us": None, "p99_us": None, "limit": "tcp",
                                  "limit_gbps": round(g, 3), "ratio": 1.0}))
        for fig in rows:
            print(json.dumps(fig))
    else:
        print(f"raw loopback TCP (Python sockets, two processes): before 1 stream {one:.2f}, "
              f"4 streams {four:.2f}; after 1 stream {one_after:.2f}, 4 streams "
              f"{four_after:.2f} GB/s -> limit {tcp_limit:.2f} GB/s (mean of the best of each)")
        print(f"single-thread memcpy (numpy, 256 MiB): {copy_limit:.2f} GB/s")
        print(f"\n{'op':<15} {'transport':<9} {'size':>8} {'GB/s':>7} {'ops/s':>9} "
              f"{'p50 us':>9} {'limit':>7} {'ratio':>6} {'vs tcp':>7}")
        for r in rows:
            vs_tcp = f"{r['ratio_tcp']:.2f}" if "ratio_tcp" in r else ""
            if r.get("limit_paired"):  # paired ratio; vs the suite limit in the last column
                vs_tcp = f"{r['ratio_suite']:.2f}*"
            print(f"{r['op']:<15} {r['transport']:<9} {human(r['size_bytes']):>8} "
                  f"{r['gbps']:>7.2f} {r['ops_per_s']:>9.0f} {r['p50_us']:>9.0f} "
                  f"{r['limit']:>7} {r['ratio']:>6.2f} {vs_tcp:>7}")


if __name__ == "__main__":
    main()
