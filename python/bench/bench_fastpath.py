"""Reads of one object through ``kvfs.fastpath``: the Python half of ``kvfs bench fs``.

``kvfs bench fs`` runs this (embedded in the binary, as ``python -c``) against the mount it
started, once per object size, right after its own Rust fast-path figure, and holds the result
against that figure, memcpy and the FUSE cold read. Standalone, against any mount::

    python python/bench/bench_fastpath.py --mount /mnt/kvfs --key bench/obj-16777216 \\
        --size 16777216 --min-ms 1000

Each read is one batch of one get into a registered buffer (``fp.get(buf, items)`` with the
items list built once, as an engine's hot loop would), timed around the call from Python, so
the figure includes everything the Python caller pays: argument parsing, the item and key
layout, the ioctl and the status read-back. It runs at least 5 reads and at least ``--min-ms``,
after one warm-up read whose bytes are checked against ``--fill`` when given. Prints one JSON
object: ``size_bytes``, ``ops``, ``bytes``, ``elapsed_s`` (time inside the calls) and
``lat_us`` (every read's latency).
"""

import argparse
import json
import sys
import time

import kvfs.fastpath


def main(argv):
    ap = argparse.ArgumentParser(description="Reads of one object through kvfs.fastpath.")
    ap.add_argument("--mount", required=True)
    ap.add_argument("--key", required=True)
    ap.add_argument("--size", type=int, required=True, help="the object's size in bytes")
    ap.add_argument("--min-ms", type=int, default=1000)
    ap.add_argument("--fill", type=lambda s: int(s, 0), default=None,
                    help="the byte every position of the object holds (checked once)")
    a = ap.parse_args(argv)
    with kvfs.fastpath.open(a.mount) as fp:
        buf = fp.alloc(a.size)
        items = [(a.key, 0, a.size)]
        want = [(0, a.size)]
        got = fp.get(buf, items)  # warm-up
        if got != want:
            sys.exit(f"get of {a.key}: {got}, expected {want}")
        if a.fill is not None:
            view = buf.numpy()
            if not (view == a.fill).all():
                sys.exit(f"get of {a.key}: the bytes are not all {a.fill:#x}")
        lat_ns = []
        get, clock = fp.get, time.perf_counter_ns
        deadline = clock() + a.min_ms * 1_000_000
        while len(lat_ns) < 5 or clock() < deadline:
            t = clock()
            got = get(buf, items)
            lat_ns.append(clock() - t)
            if got != want:
                sys.exit(f"get of {a.key}: {got}, expected {want}")
    inside = sum(lat_ns) / 1e9
    print(json.dumps({
        "size_bytes": a.size,
        "ops": len(lat_ns),
        "bytes": a.size * len(lat_ns),
        "elapsed_s": inside,
        "lat_us": [round(ns / 1e3, 3) for ns in lat_ns],
    }))


if __name__ == "__main__":
    main(sys.argv[1:])
