#!/usr/bin/env python3
"""Side-by-side benchmark of kvfs and the reference store (Mooncake) through the same Python calls.

Each system runs as its own cluster on this host: its master, a *holder* process that
contributes the memory (``setup`` with ``global_segment_size > 0``) and a *client* process
that makes the calls (``global_segment_size = 0``), both under that system's own Python.
With ``--in-process`` there is no holder: the client itself contributes the same segment
(``setup`` with ``global_segment_size`` = the holder's size), so segment and calls share ONE
process per system, as vLLM and SGLang run by default. The Pythons and masters:

* kvfs: ``--kvfs-python`` (``/opt/kvfs-bench-venv/bin/python``, our release wheel) and
  ``kvfs master`` (``--kvfs-bin``, else ``target/release/kvfs`` of this checkout, else
  ``$KVFS_BIN``);
* reference: ``--ref-venv`` (``/opt/mooncake-ref-venv``), created with ``python3 -m venv``
  when missing and given ``--ref-wheel`` (``mooncake-transfer-engine-non-cuda`` from PyPI, or
  a wheel file) with pip; its ``mooncake_master`` runs with the HTTP metadata server the
  clients name as ``http://127.0.0.1:PORT/metadata``. The reference is never installed into a
  venv that has ``kvfs``: both wheels own the ``mooncake`` package.

Both clients run the same code (this file with ``--worker``, importing
``mooncake.store.MooncakeDistributedStore``, which kvfs's wheel re-exports) with protocol
``tcp``; kvfs is forced onto TCP too (``KVFS_TRANSPORT=tcp``) unless ``--kvfs-transport auto``
lets it pick shared memory. With ``--in-process`` kvfs's default is ``auto`` (its own
selection: the embedded node serving its own process; ``--kvfs-transport tcp`` still forces
TCP) while the reference keeps its default protocol ``tcp``. For every call and size the driver runs rounds alternately on
kvfs and the reference (A, B, A, B, ...) after one untimed warm-up round each, so the
machine's drift touches both alike. The calls: ``put``/``get`` (bytes),
``put_from``/``get_into`` (registered numpy buffers), ``put_batch``/``get_batch``,
``batch_put_from``/``batch_get_into``, and ``is_exist``/``remove`` (per-key operations, the
smallest size only, in ops/s). A round is ``min(batch_bytes / size, ops_max)`` objects: one
call per object, or one batch call for them all; puts write fresh keys after an untimed
``remove_all(force=True)``, reads read objects put once, and every read is checked.

The table gives per call and size: kvfs's and the reference's GB/s (ops/s for
``is_exist``/``remove``), their ratio kvfs / reference (above 1: kvfs is faster), and the p50
latency of one call on each (of one object, or of the whole batch for the batch forms).
Raw loopback TCP (``bench_mooncake_api.raw_tcp_gbps``) is printed before and after as the
machine's limit. At the end, kvfs's figures are set against limits timed in the same rounds,
right after each round's calls (each figure's limit, of its own moments): each single 4 KiB
read's p50 against the p50 of as many raw 4 KiB request/response round trips from the kvfs
client process with plain sockets to a native blocking server (the faster of a blocking and a
polling receive); the largest size's calls, across processes, against raw loopback TCP moving
the round's bytes between two native processes (``kvfs bench raw-tcp`` to that server: plain
blocking sockets, the fastest of one stream and four in either direction, as ``kvfs bench
store`` measures its limit), and with ``--in-process`` against numpy's single-threaded memcpy
of as many bytes in the client; bytes over total time, as the figure. Beside each, the ratio
against the same limit measured apart from the figures (before and after the table) is printed
too. While one system's round (and its limit) is timed, every process of the other system is
stopped (SIGSTOP, then SIGCONT after the round; ``--no-freeze`` leaves them running): idle, the
other system's threads still wake (heartbeats, pollers), and on a 2-core machine each wake-up
takes a CPU from the calls being timed: running, the idle reference used 130-200 ms of CPU
during kvfs's rounds of a full run, and idle kvfs 400-900 ms during the reference's. A round
is under a second with the defaults, well inside both systems' liveness timeouts. The CPU
time each system's processes used while the other was timed is summed and printed (zero when
frozen). On a shared machine absolute figures are noise; the ratios are the figures.

Usage::

    python python/bench/bench_side_by_side.py --quick        # under 2 minutes
    python python/bench/bench_side_by_side.py                # 4 KiB .. 64 MiB
    python python/bench/bench_side_by_side.py --sizes 64K,1M --calls get,batch_get_into --json
    python python/bench/bench_side_by_side.py --no-ref       # kvfs only (no reference wheel)
    python python/bench/bench_side_by_side.py --in-process --quick   # segment in the client
"""

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
TAG = "@@bench "  # prefix of the workers' reply lines (the stores log to the same streams)
CALLS = ["put", "get", "put_from", "get_into", "put_batch", "get_batch", "batch_put_from",
         "batch_get_into", "is_exist", "remove"]
KEY_OPS = {"is_exist", "remove"}  # size-independent: smallest size only, in ops/s
LIMITS = "__limits"  # a worker request: the limits seen from the client process
BATCH = {"put_batch", "get_batch", "batch_put_from", "batch_get_into"}


# ----- worker: runs under either system's Python, with only numpy and mooncake.store --------


def worker(role, master, metadata, segment_bytes, buffer_bytes):
    import numpy as np
    from mooncake.store import MooncakeDistributedStore

    store = MooncakeDistributedStore()
    rc = store.setup("127.0.0.1", metadata, segment_bytes, buffer_bytes, "tcp", "", master)
    if rc != 0:
        reply({"error": f"{role} setup returned {rc}"})
        return
    if role == "holder":
        reply({"ready": True})
        sys.stdin.read()  # hold the segment until the driver closes stdin
        store.close()
        return
    src = np.random.default_rng(1).integers(0, 255, buffer_bytes // 2, dtype=np.uint8)
    dst = np.ones_like(src)  # touched: no first-use page faults inside the figures
    for buf in (src, dst):
        if store.register_buffer(buf.ctypes.data, buf.nbytes) != 0:
            reply({"error": "register_buffer failed"})
            return
    reply({"ready": True})
    rounds = Rounds(store, src, dst)
    for line in sys.stdin:
        req = json.loads(line)
        try:
            if req["call"] == LIMITS:
                reply(process_limits(req.get("raw_port"), req["size"]))
                continue
            reply(rounds.run(req["call"], req["size"], req["n"], req.get("limit"),
                             req.get("raw_port")))
        except Exception as e:  # the driver prints it and stops
            reply({"error": f"{req['call']} {req['size']}: {e}"})
    store.close()


def process_limits(raw_port, size):
    """The limits seen from the client process itself: the p50 of a raw 4 KiB request/response
    round trip with plain sockets to a native server (``kvfs bench store-peer``'s plain-thread
    raw TCP server: a 9-byte request, 4 KiB back; 2000 of them after 200 untimed), once with a
    blocking receive and once polling the socket (in a VM an idle CPU that blocked wakes slowly:
    polling is the faster, stricter limit), and a single-threaded memcpy of ``size`` bytes
    (numpy, best of 5, pages touched first)."""
    import numpy as np
    out = {}
    if raw_port:
        trips = RawRoundTrips(raw_port)  # 200 untimed
        try:
            for name, flags in (("blocking", 0), ("polling", socket.MSG_DONTWAIT)):
                p50 = statistics.median(trips.times(2000, [flags])) * 1e6
                out[f"rtt_4k_{name}_p50_us"] = p50
        finally:
            trips.conn.close()
        out["rtt_4k_p50_us"] = min(out["rtt_4k_blocking_p50_us"], out["rtt_4k_polling_p50_us"])
    src = np.ones(size, dtype=np.uint8)
    dst = np.zeros(size, dtype=np.uint8)
    best = None
    for _ in range(5):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        t = time.perf_counter() - t0
        best = t if best is None else min(best, t)
    out["memcpy_gbps"] = size / best / 1e9
    return out


class RawRoundTrips:
    """Raw 4 KiB request/response round trips from the client process to the raw server of
    ``kvfs bench store-peer`` (a plain blocking thread per connection), timed right after a
    round of single 4 KiB reads, as many as its calls: that figure's limit, of its own
    moments. The connection is made and warmed once."""

    def __init__(self, port):
        self.port = port
        self.conn = socket.create_connection(("127.0.0.1", port))
        self.conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        # op 2 (source) with the resident flag (0x80): 4 KiB from one cached buffer.
        self.req = bytes([2 | 0x80]) + (4096).to_bytes(8, "little")
        self.buf = memoryview(bytearray(4096))
        self.times(200)  # warm-up

    def times(self, count, ways=(socket.MSG_DONTWAIT, 0)):
        """`count` round trips each way of receiving in `ways` (polling the socket, blocking);
        the times of the faster way (by p50): in a VM an idle CPU that blocked wakes slowly,
        and the lower of the two is the limit."""
        best = None
        for flags in ways:
            times = []
            for _ in range(count):
                t0 = time.perf_counter()
                self.conn.sendall(self.req)
                got = 0
                while got < 4096:
                    try:
                        got += self.conn.recv_into(self.buf[got:], 0, flags)
                    except BlockingIOError:
                        pass
                times.append(time.perf_counter() - t0)
            if best is None or statistics.median(times) < statistics.median(best):
                best = times
        return best


def reply(obj):
    sys.stdout.write(TAG + json.dumps(obj) + "\n")
    sys.stdout.flush()


class Rounds:
    """One timed round of a call: the untimed preparation, the timed calls, the check."""

    def __init__(self, store, src, dst):
        self.store, self.src, self.dst = store, src, dst
        # Addresses read once: numpy builds a new ctypes object on every ``.ctypes`` (about
        # 1 us), which inside the timed calls was 1 ms of a 1024-item batch, for both systems.
        self.src_addr, self.dst_addr = src.ctypes.data, dst.ctypes.data
        self.seq = 0
        self.stored = None  # (size, n, keys) put from src since the last remove_all
        self.raw = None  # RawRoundTrips, made at the first round that needs them

    def fresh(self, size, n):
        self.store.remove_all(force=True)
        self.stored = None
        self.seq += 1
        return [f"sbs/{size}/{self.seq}/{i}" for i in range(n)]

    def ensure_stored(self, size, n):
        if self.stored and self.stored[:2] == (size, n):
            return self.stored[2]
        keys = self.fresh(size, n)
        codes = self.store.batch_put_from(keys, self.ptrs(self.src_addr, size, n), [size] * n)
        ok(codes, "batch_put_from (preparation)")
        self.stored = (size, n, keys)
        return keys

    @staticmethod
    def ptrs(addr, size, n):
        return [addr + i * size for i in range(n)]

    def run(self, call, size, n, limit=None, raw_port=None):
        s, nbytes = self.store, size * n
        sizes = [size] * n
        value = self.src[:size].tobytes()
        read = call in ("get", "get_into", "get_batch", "batch_get_into", "is_exist")
        keys = self.ensure_stored(size, n) if read else self.fresh(size, n)
        # The arguments are built before the clock starts: the figures time the stores' calls.
        src_ptrs, dst_ptrs = self.ptrs(self.src_addr, size, n), self.ptrs(self.dst_addr, size, n)
        values = [value] * n
        if call == "remove":
            ok(s.batch_put_from(keys, src_ptrs, sizes), "batch_put_from")
        # Each call's result is checked after its clock stops.
        if call in BATCH:
            fn, check = {
                "put_batch": (lambda: s.put_batch(keys, values),
                              lambda r: ok(r, "put_batch")),
                "get_batch": (lambda: s.get_batch(keys), lambda r: check_lens(r, size)),
                "batch_put_from": (lambda: s.batch_put_from(keys, src_ptrs, sizes),
                                   lambda r: ok(r, "batch_put_from")),
                "batch_get_into": (lambda: s.batch_get_into(keys, dst_ptrs, sizes),
                                   lambda r: ok(r, "batch_get_into")),
            }[call]
            t0 = time.perf_counter()
            r = fn()
            times = [time.perf_counter() - t0]
            check(r)
            del r
        else:
            one, check = {
                "put": (lambda i, k: s.put(k, value), lambda r: ok(r, "put")),
                "get": (lambda i, k: s.get(k), lambda r: check_lens([r], size)),
                "put_from": (lambda i, k: s.put_from(k, src_ptrs[i], size),
                             lambda r: ok(r, "put_from")),
                "get_into": (lambda i, k: s.get_into(k, dst_ptrs[i], size),
                             lambda r: ok(r, "get_into")),
                "is_exist": (lambda i, k: s.is_exist(k), lambda r: ok(r - 1, "is_exist")),
                "remove": (lambda i, k: s.remove(k, True), lambda r: ok(r, "remove")),
            }[call]
            times = []
            for i, k in enumerate(keys):
                t0 = time.perf_counter()
                r = one(i, k)
                times.append(time.perf_counter() - t0)
                check(r)
                del r  # a value is freed before the next call, as when it was not kept
        if call in ("get_into", "batch_get_into"):
            if not (self.src[:nbytes] == self.dst[:nbytes]).all():
                raise RuntimeError("read back wrong bytes")
            self.dst[:nbytes] = 1
        out = {"times": times, "bytes": 0 if call in KEY_OPS else nbytes, "ops": n}
        if limit == "memcpy":
            out["memcpy_times"] = self.memcpys(nbytes // len(times), len(times))
        elif limit == "rtt":
            if self.raw is None or self.raw.port != raw_port:
                self.raw = RawRoundTrips(raw_port)
            out["rtt_times"] = self.raw.times(n)
        return out

    def memcpys(self, nbytes, count):
        """The limit of this round's moment: `count` single-threaded memcpys (numpy, between
        touched buffers) of `nbytes` each, as many and as large as the round's timed calls."""
        import numpy as np
        times = []
        for _ in range(count):
            t0 = time.perf_counter()
            np.copyto(self.dst[:nbytes], self.src[:nbytes])
            times.append(time.perf_counter() - t0)
        self.dst[:nbytes] = 1  # the next read's check must not find these bytes already there
        return times


def ok(rc, what):
    bad = [r for r in (rc if isinstance(rc, list) else [rc]) if r < 0]
    if bad:
        raise RuntimeError(f"{what} returned {bad[0]}")


def check_lens(values, size):
    if any(len(v) != size for v in values):
        raise RuntimeError("get returned a short or empty value")


# ----- driver: the clusters ------------------------------------------------------------------


class System:
    """One system's master, holder (none with ``--in-process``) and client; ``round`` runs one
    round on the client."""

    def __init__(self, name, python, master_cmd, master_ok, rpc_port, metadata, env, args, tmp):
        self.name, self.procs = name, []
        self.log_path = os.path.join(tmp, f"{name}.log")
        self.log = open(self.log_path, "wb")
        self.procs.append(subprocess.Popen(master_cmd, stdin=subprocess.DEVNULL, stdout=self.log,
                                           stderr=self.log))
        wait_for(master_ok, self, f"the {name} master ({' '.join(master_cmd)})")
        master = f"127.0.0.1:{rpc_port}"
        base = [python, os.path.abspath(__file__), "--worker", "--master", master,
                "--metadata", metadata, "--buffer-bytes", str(2 * args.batch_bytes)]
        if args.in_process:  # no holder: the client contributes the segment itself
            client_segment = args.segment_bytes
        else:
            client_segment = 0
            self.holder = self.start(base + ["--role", "holder", "--segment-bytes",
                                             str(args.segment_bytes)], env=env)
            self.expect(self.holder, "holder")
            # the holder's stdout is read no more: drain it so that its prints never block it
            threading.Thread(target=lambda: [self.log.write(x.encode()) for x in self.holder.stdout],
                             daemon=True).start()
        self.client = self.start(base + ["--role", "client", "--segment-bytes",
                                         str(client_segment)], env=env)
        self.expect(self.client, "client")

    def start(self, cmd, env):
        p = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log,
                             env=env, text=True)
        self.procs.append(p)
        return p

    def expect(self, proc, what):
        for line in proc.stdout:
            if line.startswith(TAG):
                msg = json.loads(line[len(TAG):])
                if "error" in msg:
                    self.fail(f"{what}: {msg['error']}")
                return msg
            self.log.write(line.encode())
        self.fail(f"the {what} process exited (rc {proc.wait()})")

    def limits(self, size, raw_port):
        """The raw round trip to `raw_port` and memcpy, measured in the client process."""
        req = {"call": LIMITS, "size": size, "raw_port": raw_port}
        self.client.stdin.write(json.dumps(req) + "\n")
        self.client.stdin.flush()
        return self.expect(self.client, "client")

    def round(self, call, size, n, limit=None, raw_port=None):
        req = {"call": call, "size": size, "n": n, "limit": limit, "raw_port": raw_port}
        self.client.stdin.write(json.dumps(req) + "\n")
        self.client.stdin.flush()
        return self.expect(self.client, "client")

    def fail(self, why):
        self.log.flush()
        with open(self.log_path, "rb") as f:
            tail = f.read()[-2000:].decode(errors="replace")
        raise SystemExit(f"{self.name}: {why}\n--- last lines of {self.log_path} ---\n{tail}")

    def freeze(self, stop):
        """Stops (`stop`) or resumes every process of this system; a stop returns once each
        process is stopped (a process stops when its threads next run: an idle one, at once)."""
        for p in self.procs:
            if p.poll() is None:
                os.kill(p.pid, signal.SIGSTOP if stop else signal.SIGCONT)
        if not stop:
            return
        deadline = time.monotonic() + 2.0
        for p in self.procs:
            while p.poll() is None and time.monotonic() < deadline:
                try:
                    with open(f"/proc/{p.pid}/stat") as f:
                        if f.read().rsplit(")", 1)[1].split()[0] in ("T", "t"):
                            break
                except OSError:
                    break
                time.sleep(0.0005)

    def cpu_seconds(self):
        """CPU time (user + system, all threads) its processes have used so far."""
        tick, total = os.sysconf("SC_CLK_TCK"), 0.0
        for p in self.procs:
            try:
                with open(f"/proc/{p.pid}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                total += (int(fields[11]) + int(fields[12])) / tick
            except (OSError, IndexError, ValueError):
                pass  # gone: it uses no more
        return total

    def stop(self):
        """Workers leave when their stdin closes (the store's close); then the master."""
        for p in reversed(self.procs[1:]):
            p.stdin.close()
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        self.procs[0].terminate()
        self.procs[0].wait(timeout=10)


def port_open(port):
    try:
        socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
        return True
    except OSError:
        return False


def wait_for(pred, system, what, timeout=30):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(p.poll() is not None for p in system.procs):
            system.fail(f"{what} exited (rc {system.procs[-1].poll()})")
        if pred():
            return
        time.sleep(0.1)
    system.fail(f"{what} did not listen within {timeout} s")


def kvfs_binary(args):
    binary = args.kvfs_bin or os.path.join(REPO, "target", "release", "kvfs")
    if not os.access(binary, os.X_OK):
        binary = os.environ.get("KVFS_BIN", "")
    if not os.access(binary, os.X_OK):
        sys.exit("no kvfs binary: cargo build --release --bin kvfs, or --kvfs-bin / $KVFS_BIN")
    return binary


def raw_server(args, system):
    """Starts ``kvfs bench store-peer`` (its raw TCP server is a plain blocking thread per
    connection, as ``kvfs bench store`` measures its round-trip limit against) as one more
    process of `system`; returns the raw server's port."""
    p = subprocess.Popen([kvfs_binary(args), "bench", "store-peer", "--dram", "16777216"],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=system.log, text=True)
    system.procs.append(p)
    words = p.stdout.readline().split()
    if len(words) != 3 or words[0] != "READY":
        system.fail(f"kvfs bench store-peer answered {words}")
    return int(words[2].rsplit(":", 1)[1])


class RawTcpTimes:
    """``kvfs bench raw-tcp``: raw loopback TCP between two native processes (it and the raw
    server of ``kvfs bench store-peer``), plain blocking sockets cycling through 64 MiB of
    memory on each side, the fastest of one stream and four in either direction (as
    ``kvfs bench store`` measures its limit), moving a round's bytes right after the round:
    that figure's limit, of its own moments."""

    def __init__(self, args, system, raw_port):
        self.proc = subprocess.Popen(
            [kvfs_binary(args), "bench", "raw-tcp", "--addr", f"127.0.0.1:{raw_port}"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=system.log, text=True)
        system.procs.append(self.proc)
        self.system = system

    def times(self, nbytes, count):
        """`count` transfers of `nbytes`, each the fastest of either direction over one stream
        and over four: loopback moves bytes between two processes the same way whichever
        starts the transfer, so a figure in either direction is held against the best."""
        self.proc.stdin.write(f"both {nbytes} {count}\n")
        self.proc.stdin.flush()
        words = self.proc.stdout.readline().split()
        if not words or words[0] != "TIMES" or len(words) != count + 1:
            self.system.fail(f"kvfs bench raw-tcp answered {' '.join(words) or 'nothing'}")
        return [float(w) for w in words[1:]]


def worker_env(base):
    """A worker's environment: numpy's BLAS without its own thread pool (its threads spin after
    use, and on a 2-core machine they take the CPU from whichever system is being timed)."""
    env = dict(base)
    env.setdefault("OPENBLAS_NUM_THREADS", "1")
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def kvfs_system(args, tmp, free_port):
    binary = kvfs_binary(args)
    rpc, admin = free_port(), free_port()
    cmd = [binary, "master", f"--rpc_port={rpc}", "--rpc_address=127.0.0.1",
           f"--metrics_port={admin}", "--metrics_host=127.0.0.1"]
    env = worker_env(os.environ)
    if args.kvfs_transport == "tcp":
        env["KVFS_TRANSPORT"] = "tcp"
    else:  # auto: kvfs's own selection, whatever this shell's environment says
        env.pop("KVFS_TRANSPORT", None)
    return System("kvfs", args.kvfs_python, cmd, lambda: port_open(rpc), rpc, "P2PHANDSHAKE",
                  env, args, tmp)


def ref_python(args):
    """The reference venv's python, created and given the wheel when missing."""
    venv = args.ref_venv
    py = os.path.join(venv, "bin", "python")
    probe = "import mooncake.store, numpy"
    if os.access(py, os.X_OK) and subprocess.run([py, "-c", "import kvfs"],
                                                 capture_output=True).returncode == 0:
        sys.exit(f"{venv} has kvfs installed: the reference wheel must have a venv of its own "
                 "(both own the mooncake package); pass another --ref-venv")
    if os.access(py, os.X_OK) and subprocess.run([py, "-c", probe], capture_output=True).returncode == 0:
        return py
    if not os.access(py, os.X_OK):
        r = subprocess.run(["python3", "-m", "venv", venv], capture_output=True, text=True)
        if r.returncode != 0:
            sys.exit(f"cannot create the reference venv {venv}: python3 -m venv {venv}:\n"
                     f"{r.stderr[-2000:]}")
    cmd = [py, "-m", "pip", "install", "--disable-pip-version-check", args.ref_wheel, "numpy"]
    print(f"installing the reference: {' '.join(cmd)}", file=sys.stderr)
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0 or subprocess.run([py, "-c", probe]).returncode != 0:
        sys.exit(f"cannot install the reference wheel ({' '.join(cmd)}): rc {r.returncode}\n"
                 f"{(r.stdout + r.stderr)[-2000:]}\nwithout network: pip download "
                 f"{args.ref_wheel} elsewhere and pass --ref-wheel FILE.whl, or run --no-ref "
                 "(kvfs only)")
    return py


def ref_system(args, tmp, free_port):
    py = ref_python(args)
    master = os.path.join(os.path.dirname(py), "mooncake_master")
    if not os.access(master, os.X_OK):
        sys.exit(f"no mooncake_master in {os.path.dirname(py)}: is {args.ref_wheel} installed?")
    rpc, http, admin = free_port(), free_port(), free_port()
    cmd = [master, f"--rpc_port={rpc}", "--rpc_address=127.0.0.1",
           "--enable_http_metadata_server=true", "--http_metadata_server_host=127.0.0.1",
           f"--http_metadata_server_port={http}", f"--metrics_port={admin}"]
    return System("reference", py, cmd, lambda: port_open(rpc) and port_open(http), rpc,
                  f"http://127.0.0.1:{http}/metadata", worker_env(os.environ), args, tmp)


# ----- driver: rounds and the table ----------------------------------------------------------


def summarize(replies):
    total = sum(sum(r["times"]) for r in replies)
    lat = [t for r in replies for t in r["times"]]
    out = {
        "others_cpu_ms": sum(r.get("others_cpu_s", 0.0) for r in replies) * 1e3,
        "gbps": sum(r["bytes"] for r in replies) / total / 1e9,
        "ops_per_s": sum(r["ops"] for r in replies) / total,
        "p50_us": statistics.median(lat) * 1e6,
        "rounds": len(replies),
    }
    for kind in ("memcpy", "tcp"):
        if replies and all(f"{kind}_times" in r for r in replies):
            # The same statistic as the figure: bytes over the total time of as many copies
            # (or raw TCP transfers).
            out[f"{kind}_gbps"] = (sum(r["bytes"] for r in replies)
                                   / sum(sum(r[f"{kind}_times"]) for r in replies) / 1e9)
    if replies and all("rtt_times" in r for r in replies):
        out["rtt_p50_us"] = statistics.median(t for r in replies for t in r["rtt_times"]) * 1e6
    return out


def round_limit(call, size, sizes, args):
    """The limit kvfs's rounds of this figure time right after their calls, if any: memcpys
    of as many bytes (in one process) or raw TCP moving as many bytes (across processes) for
    the largest size, and as many raw 4 KiB round trips for the single 4 KiB reads."""
    if size == max(sizes) and size >= 1 << 20 and call not in KEY_OPS:
        return "memcpy" if args.in_process else "tcp"
    if not args.in_process and size == 4096 and call in RTT_CALLS:
        return "rtt"
    return None


RTT_CALLS = ("get", "get_into", "is_exist")  # single 4 KiB reads, held against a round trip


def measure(systems, calls, sizes, args, emit, raw_port=None, raw_tcp=None):
    for size in sizes:
        for call in calls:
            if call in KEY_OPS and size != sizes[0]:
                continue
            n = max(1, min(args.batch_bytes // size, args.ops_max))
            got = {s.name: [] for s in systems}
            # kvfs's rounds of some figures also time that figure's limit right after their
            # calls: the limit of its own moments (`round_limit`).
            limit = round_limit(call, size, sizes, args)
            for s in systems:
                s.round(call, size, n)  # warm-up, untimed
            for _ in range(args.rounds):
                for s in systems:  # A, B, A, B: drift touches both alike
                    mine = limit if s.name == "kvfs" else None
                    others = [o for o in systems if o is not s]
                    for o in others if args.freeze else ():
                        o.freeze(True)
                    try:
                        idle = sum(o.cpu_seconds() for o in others)
                        done = s.round(call, size, n, None if mine == "tcp" else mine, raw_port)
                        # What the other system took of the CPU while this one was timed (it
                        # should be idle: each round waits for the last one's answer).
                        done["others_cpu_s"] = sum(o.cpu_seconds() for o in others) - idle
                        if mine == "tcp":  # as many bytes, right after
                            done["tcp_times"] = raw_tcp.times(size * n, 1)
                    finally:
                        for o in others if args.freeze else ():
                            o.freeze(False)
                    got[s.name].append(done)
            row = {"call": call, "size_bytes": size, "objects_per_round": n}
            for name, replies in got.items():
                row[name] = {k: round(v, 3) for k, v in summarize(replies).items()}
            if len(systems) == 2:
                k, r = row["kvfs"], row["reference"]
                key = "ops_per_s" if call in KEY_OPS else "gbps"
                row["ratio"] = round(k[key] / r[key], 3) if r[key] else None
            emit(row)


def print_row(row, with_ref):
    from bench_mooncake_api import human
    key = "ops_per_s" if row["call"] in KEY_OPS else "gbps"
    unit = "ops/s" if key == "ops_per_s" else "GB/s"
    fmt = "{:>10.0f}" if key == "ops_per_s" else "{:>10.3f}"
    k = row["kvfs"]
    line = f"{row['call']:<15} {human(row['size_bytes']):>8} {unit:>5} " + fmt.format(k[key])
    if with_ref:
        r = row["reference"]
        line += " " + fmt.format(r[key]) + f" {row['ratio']:>6.2f}"
        line += f" {k['p50_us']:>10.0f} {r['p50_us']:>10.0f}"
    else:
        line += f" {k['p50_us']:>10.0f}"
    print(line, flush=True)


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true",
                    help="sizes 4K,64K,1M,16M, 4 rounds, 64 MiB batches: well within 2 minutes")
    ap.add_argument("--sizes", default=None, help="object sizes, K/M/G binary "
                    "(default 4K,64K,1M,16M,64M)")
    ap.add_argument("--calls", default=",".join(CALLS), help="calls to measure, comma separated")
    ap.add_argument("--rounds", type=int, default=None, help="timed rounds per system (default 5)")
    ap.add_argument("--batch-bytes", default=None, help="bytes per round (default 128M)")
    ap.add_argument("--ops-max", type=int, default=None,
                    help="most objects per round (default 1024; 256 with --quick)")
    ap.add_argument("--limit-bytes", default=None, help="bytes sent to measure raw TCP "
                    "(default 1G; 256M with --quick)")
    ap.add_argument("--json", action="store_true", help="one JSON object per figure")
    ap.add_argument("--kvfs-python", default="/opt/kvfs-bench-venv/bin/python",
                    help="python with our kvfs wheel (default %(default)s)")
    ap.add_argument("--kvfs-bin", default=None,
                    help="kvfs binary for the master (default target/release/kvfs, $KVFS_BIN)")
    ap.add_argument("--in-process", action="store_true",
                    help="no holder process: each system's client contributes the segment "
                    "itself (global_segment_size = the holder's size), segment and calls in one "
                    "process as vLLM and SGLang run by default; kvfs's transport defaults to "
                    "auto there, the reference keeps its default protocol tcp")
    ap.add_argument("--kvfs-transport", choices=("tcp", "auto"), default=None,
                    help="tcp: KVFS_TRANSPORT=tcp, as the reference's protocol; auto: kvfs "
                    "picks (shared memory on one host; its own process's embedded node with "
                    "--in-process). Default tcp, auto with --in-process")
    ap.add_argument("--ref-venv", default="/opt/mooncake-ref-venv",
                    help="the reference's own venv, created when missing (default %(default)s)")
    ap.add_argument("--ref-wheel", default="mooncake-transfer-engine-non-cuda",
                    help="pip requirement or wheel file of the reference (default %(default)s)")
    ap.add_argument("--no-ref", action="store_true", help="kvfs only")
    ap.add_argument("--no-freeze", dest="freeze", action="store_false",
                    help="leave the other system's processes running while one is timed "
                         "(by default they are stopped with SIGSTOP for the round)")
    # worker mode (internal)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--role", help=argparse.SUPPRESS)
    ap.add_argument("--master", help=argparse.SUPPRESS)
    ap.add_argument("--metadata", help=argparse.SUPPRESS)
    ap.add_argument("--segment-bytes", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--buffer-bytes", type=int, help=argparse.SUPPRESS)
    return ap.parse_args()


def main():
    args = parse_args()
    if args.worker:
        return worker(args.role, args.master, args.metadata, args.segment_bytes, args.buffer_bytes)
    try:
        import bench_mooncake_api as api  # needs kvfs and numpy: the driver runs under kvfs's python
    except ImportError:
        if sys.prefix == os.path.dirname(os.path.dirname(os.path.abspath(args.kvfs_python))):
            raise  # already kvfs's python
        os.execv(args.kvfs_python, [args.kvfs_python, os.path.abspath(__file__)] + sys.argv[1:])
    q = args.quick
    args.kvfs_transport = args.kvfs_transport or ("auto" if args.in_process else "tcp")
    mode = "in-process (segment in the client)" if args.in_process else "holder + client"
    sizes = [api.parse_size(s) for s in (args.sizes or ("4K,64K,1M,16M" if q else "4K,64K,1M,16M,64M")).split(",")]
    calls = [c.strip() for c in args.calls.split(",") if c.strip()]
    unknown = set(calls) - set(CALLS)
    if unknown:
        sys.exit(f"unknown calls {sorted(unknown)}; known: {','.join(CALLS)}")
    args.rounds = args.rounds or (4 if q else 5)
    args.ops_max = args.ops_max or (256 if q else 1024)
    args.batch_bytes = max(api.parse_size(args.batch_bytes or ("64M" if q else "128M")), max(sizes))
    args.segment_bytes = 2 * args.batch_bytes + (64 << 20)
    limit_bytes = api.parse_size(args.limit_bytes or ("256M" if q else "1G"))

    def tcp_limit():
        return max(api.raw_tcp_gbps(limit_bytes, 1), api.raw_tcp_gbps(limit_bytes, 4))

    before = tcp_limit()
    rows = []
    with_ref = not args.no_ref
    with tempfile.TemporaryDirectory() as tmp:
        systems = []
        try:
            systems.append(kvfs_system(args, tmp, api.free_port))
            if with_ref:
                systems.append(ref_system(args, tmp, api.free_port))
            profile = subprocess.run(
                [args.kvfs_python, "-c",
                 "import kvfs._native as n; print(getattr(n, 'BUILD_PROFILE', 'unknown'))"],
                capture_output=True, text=True).stdout.strip() or "unknown"
            if profile != "release":
                print(f"warning: the kvfs wheel of {args.kvfs_python} is not a release build "
                      f"({profile}): its "
                      "figures are not kvfs's (install a release wheel)", file=sys.stderr)
            if not args.json:
                print(f"mode {mode}; raw loopback TCP before: {before:.2f} GB/s; kvfs "
                      f"wheel {profile}, transport {args.kvfs_transport}"
                      f"{'' if args.no_ref else ', reference protocol tcp'}; "
                      f"{args.rounds} rounds each, interleaved"
                      + (", the other system stopped while one is timed"
                         if args.freeze and with_ref else ""))
                head = f"{'call':<15} {'size':>8} {'unit':>5} {'kvfs':>10}"
                if with_ref:
                    head += f" {'reference':>10} {'ratio':>6} {'kvfs p50us':>10} {'ref p50us':>10}"
                else:
                    head += f" {'p50 us':>10}"
                print(head, flush=True)

            def emit(row):
                row["mode"] = "in-process" if args.in_process else "holder"
                row["kvfs_transport"] = args.kvfs_transport
                rows.append(row)
                print(json.dumps(row), flush=True) if args.json else print_row(row, with_ref)

            raw_port = None if args.in_process else raw_server(args, systems[0])
            raw_tcp = None if args.in_process else RawTcpTimes(args, systems[0], raw_port)
            local = [systems[0].limits(max(sizes), raw_port)]
            measure(systems, calls, sizes, args, emit, raw_port, raw_tcp)
            local.append(systems[0].limits(max(sizes), raw_port))
        finally:
            for s in systems:
                s.stop()
    after = tcp_limit()
    if args.json:
        print(json.dumps({"limit": "raw loopback tcp", "before_gbps": round(before, 3),
                          "after_gbps": round(after, 3),
                          "mode": "in-process" if args.in_process else "holder",
                          "kvfs_transport": args.kvfs_transport}))
    else:
        print(f"raw loopback TCP after: {after:.2f} GB/s")
        if with_ref and rows:
            took = {n: sum(r[n]["others_cpu_ms"] for r in rows) for n in ("kvfs", "reference")}
            print(f"CPU the other system used while one was timed: {took['kvfs']:.0f} ms in "
                  f"kvfs's rounds, {took['reference']:.0f} ms in the reference's")
        print("ratio = kvfs / reference; above 1 kvfs is faster" if with_ref
              else "reference not run (--no-ref): kvfs figures only")
    print_limits(rows, local, (before + after) / 2, max(sizes), args)


def print_limits(rows, local, tcp_gbps, big, args):
    """kvfs's figures against the limits seen from its client process, each of its own
    moments: every single 4 KiB read's p50 against the p50 of raw 4 KiB round trips timed
    right after each of its rounds (across processes), and the largest size's calls against
    raw loopback TCP moving as many bytes right after each round (across processes) or
    memcpys of as many bytes (in one process), the same statistic as the figure: bytes over
    total time. Beside each, the ratio against the limit measured apart from the figures
    (round trips before and after the table, the lower; raw TCP before and after, the mean;
    the best of five memcpys), as this bench gave it before the limits were timed per round."""
    rtts = [x["rtt_4k_p50_us"] for x in local if "rtt_4k_p50_us" in x]
    memcpy = max(x["memcpy_gbps"] for x in local)
    figures = []
    for r in rows:
        k = r["kvfs"]
        if r["size_bytes"] == 4096 and r["call"] in RTT_CALLS and "rtt_p50_us" in k:
            figures.append({"figure": f"{r['call']} 4 KiB p50 / raw 4 KiB round trip",
                            "kvfs_p50_us": k["p50_us"], "rtt_p50_us": round(k["rtt_p50_us"], 1),
                            "ratio": round(k["p50_us"] / k["rtt_p50_us"], 2),
                            "ratio_apart": round(k["p50_us"] / min(rtts), 2) if rtts else None})
    from bench_mooncake_api import human
    kind, name, apart = (("memcpy", "memcpy", memcpy) if args.in_process
                         else ("tcp", "raw loopback TCP", tcp_gbps))
    for r in rows:
        k = r["kvfs"]
        if big >= 1 << 20 and r["size_bytes"] == big and f"{kind}_gbps" in k:
            g, limit = k["gbps"], k[f"{kind}_gbps"]
            figures.append({"figure": f"{r['call']} {human(big)} GB/s / {name}",
                            "kvfs_gbps": g, "limit_gbps": round(limit, 3),
                            "ratio": round(g / limit, 2), "ratio_apart": round(g / apart, 2)})
    if args.json:
        for f in figures:
            print(json.dumps(f))
        return
    blocking = [x["rtt_4k_blocking_p50_us"] for x in local if "rtt_4k_blocking_p50_us" in x]
    print(f"limits in the kvfs client process: memcpy {memcpy:.2f} GB/s (best of 5)"
          + (f", raw 4 KiB round trip p50 {min(rtts):.1f} us polling, {min(blocking):.1f} us "
             "blocking (before and after the table)" if rtts else ""))
    print(f"  {'figure':<48} {'limit':>10} {'ratio':>6} {'apart':>6}")
    for f in figures:
        lim = (f"{f['rtt_p50_us']:.1f} us" if "rtt_p50_us" in f
               else f"{f['limit_gbps']:.2f} GB/s")
        apart = "-" if f["ratio_apart"] is None else f"{f['ratio_apart']:.2f}"
        print(f"  {f['figure']:<48} {lim:>10} {f['ratio']:>6.2f} {apart:>6}")


if __name__ == "__main__":
    main()
