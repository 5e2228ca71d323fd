"""The reference store class (``mooncake.store.MooncakeDistributedStore``) against a real
kvfs master and node: arguments, return codes and semantics of every call."""

import threading
import time

import numpy as np
import pytest

from conftest import LEASE_TTL_S, run_python
from mooncake.store import (
    MooncakeDistributedStore,
    ObjectDataType,
    ReplicateConfig,
    SoftPinAction,
)
import kvfs

NOT_FOUND = -704
HAS_LEASE = -706
INVALID_PARAMS = -600
NOT_SUPPORTED = -1012


def test_error_codes_are_the_references():
    assert kvfs.ERROR_CODES["OBJECT_HAS_LEASE"] == -706
    assert kvfs.ERROR_CODES["OBJECT_NOT_FOUND"] == -704
    assert kvfs.ERROR_CODES["NO_AVAILABLE_HANDLE"] == -200
    assert kvfs.ERROR_CODES["INVALID_PARAMS"] == -600
    assert kvfs.ERROR_CODES["RPC_TIMEOUT"] == -901
    # Every kvfs error kind maps to one of them.
    assert set(kvfs.KIND_CODES.values()) <= set(kvfs.ERROR_CODES.values())
    assert kvfs.KIND_CODES["leased"] == -706 and kvfs.KIND_CODES["no_space"] == -200


def test_the_build_profile_is_told():
    # Benchmarks print it and warn about anything but a release build.
    assert kvfs.BUILD_PROFILE in ("debug", "release")
    assert kvfs._native.BUILD_PROFILE == kvfs.BUILD_PROFILE


def test_setup_positional_and_hostname(cluster):
    s = MooncakeDistributedStore()
    assert s.setup("localhost", "P2PHANDSHAKE", 0, 16 << 20, "tcp", "", cluster.master) == 0
    host, port = s.get_hostname().split(":")
    assert host == "localhost" and 12300 <= int(port) <= 14300
    assert s.health_check() == 0
    assert s.close() == 0
    assert s.health_check() == 1
    assert s.close() == 0  # idempotent


def test_setup_positional_requires_seven_arguments(cluster):
    with pytest.raises(TypeError):
        MooncakeDistributedStore().setup("localhost", "P2PHANDSHAKE", 0)


def test_setup_dict_form(cluster, key):
    s = MooncakeDistributedStore()
    cfg = {
        "local_hostname": "localhost",
        "metadata_server": "http://127.0.0.1:%d/metadata" % cluster.metadata_port,
        "global_segment_size": "16MB",
        "local_buffer_size": "16 MB",
        "protocol": "tcp",
        "master_server_addr": cluster.master,
    }
    assert s.setup(cfg) == 0
    try:
        assert s.put(key, b"dict form") == 0
        assert s.get(key) == b"dict form"
    finally:
        s.close()
    bad = dict(cfg, global_segment_size="50%")
    assert MooncakeDistributedStore().setup(bad) != 0
    assert MooncakeDistributedStore().setup({"local_hostname": "localhost"}) == INVALID_PARAMS


def test_setup_fails_with_a_code_when_the_master_is_unreachable(cluster):
    from conftest import free_port

    s = MooncakeDistributedStore()
    t0 = time.monotonic()
    rc = s.setup("localhost", "P2PHANDSHAKE", 0, 16 << 20, "tcp", "", f"127.0.0.1:{free_port()}")
    assert rc < 0 and time.monotonic() - t0 < 10
    # An etcd with no leader (here: no etcd) is the same failure, within the call's deadline.
    t0 = time.monotonic()
    rc = s.setup("localhost", "P2PHANDSHAKE", 0, 16 << 20, "tcp", "", f"etcd://127.0.0.1:{free_port()}")
    assert rc == -900 and time.monotonic() - t0 < 10
    # kvfs finds its leader through etcd only.
    assert s.setup("localhost", "P2PHANDSHAKE", 0, 16 << 20, "tcp", "", "redis://a:6379") == NOT_SUPPORTED


def test_calls_before_setup_return_codes():
    s = MooncakeDistributedStore()
    assert s.put("k", b"v") == INVALID_PARAMS
    assert s.get("k") == b""
    assert s.get_batch(["k", "j"]) == [b""]  # the reference's quirk
    assert s.is_exist("k") < 0
    assert s.get_size("k") < 0
    assert s.remove("k") < 0
    assert s.get_hostname() == ""
    assert s.health_check() == 1


def test_put_get_round_trip_and_miss_conventions(store, key):
    data = b"Hello, World!"
    assert store.put(key, data) == 0
    assert store.get_size(key) == len(data)
    assert store.get(key) == data
    assert store.is_exist(key) == 1
    assert store.get("missing-" + key) == b""
    assert store.is_exist("missing-" + key) == 0
    assert store.get_size("missing-" + key) == NOT_FOUND
    assert store.get_buffer("missing-" + key) is None
    assert store.remove("missing-" + key) == NOT_FOUND


def test_numpy_values_round_trip(store, key):
    a = np.random.default_rng(1).standard_normal((256, 257)).astype(np.float32)
    assert store.put(key, a) == 0  # any buffer-protocol object
    back = np.frombuffer(store.get(key), dtype=np.float32).reshape(a.shape)
    assert np.array_equal(a, back)
    assert store.put(key + "-mv", memoryview(a.tobytes())[8:]) == 0
    assert store.get(key + "-mv") == a.tobytes()[8:]


def test_first_writer_wins_and_upsert_replaces(store, key):
    # get_size grants no lease in kvfs, so the upserts below are not refused by one.
    assert store.put(key, b"first") == 0
    assert store.put(key, b"second, longer") == 0  # success, value kept
    assert store.get_size(key) == len(b"first")
    assert store.upsert(key, b"third!") == 0
    assert store.get_size(key) == len(b"third!")
    assert store.upsert(key, b"a different size now") == 0
    assert store.upsert_parts(key, b"p1-", b"p2") == 0
    assert store.get(key) == b"p1-p2"
    # Readers hold it now (read lease): the reference's "replica busy" for an upsert.
    assert store.upsert(key, b"busy") == -714
    time.sleep(LEASE_TTL_S + 0.3)
    assert store.upsert(key, b"after the lease") == 0
    assert store.get(key) == b"after the lease"
    keys = [key + "-b0", key + "-b1"]
    assert store.put_batch(keys, [b"x0", b"x1"]) == 0
    assert store.upsert_batch(keys, [b"y0", b"y1"]) == 0
    assert store.get_batch(keys) == [b"y0", b"y1"]


def test_lease_blocks_remove_until_it_expires(store, key):
    assert store.put(key, b"leased") == 0
    assert store.get(key) == b"leased"  # grants a read lease (500 ms here)
    assert store.remove(key) == HAS_LEASE
    assert store.is_exist(key) == 1  # refreshes it
    assert store.remove(key) == HAS_LEASE
    time.sleep(LEASE_TTL_S + 0.3)
    assert store.remove(key) == 0
    assert store.remove(key) == NOT_FOUND
    assert store.put(key, b"again") == 0
    assert store.get(key) == b"again"
    assert store.remove(key, force=True) == 0  # force ignores the lease
    assert store.get(key) == b""


def test_put_parts_concatenates(store, key):
    header = b"H" * 28
    body = np.arange(1000, dtype=np.uint16)
    assert store.put_parts(key, header, body) == 0
    assert store.get(key) == header + body.tobytes()


def test_put_batch_and_get_batch(store, key):
    keys = [f"{key}-{i}" for i in range(5)]
    values = [bytes([i]) * (1000 + i) for i in range(5)]
    assert store.put_batch(keys, values) == 0
    assert store.get_batch(keys) == values
    assert store.get_batch(keys[:2] + ["missing-" + key]) == values[:2] + [b""]
    assert store.put_batch(keys, values[:3]) == INVALID_PARAMS
    assert store.batch_is_exist(keys + ["missing-" + key]) == [1] * 5 + [0]
    assert store.batch_is_exist([]) == []


def test_get_buffer_exports_the_bytes(store, key):
    data = np.arange(4096, dtype=np.uint8).tobytes()
    assert store.put(key, data) == 0
    h = store.get_buffer(key)
    assert h is not None and h.size() == len(data) and len(h) == len(data) and h.ptr() != 0
    assert bytes(h) == data
    assert np.array_equal(np.asarray(h), np.frombuffer(data, dtype=np.uint8))
    hs = store.batch_get_buffer([key, "missing-" + key])
    assert bytes(hs[0]) == data and hs[1] is None
    assert store.batch_get_buffer([]) == []


def test_zero_copy_batch_calls_into_registered_buffers(store, key):
    n, size = 8, 256 << 10
    src = np.random.default_rng(2).integers(0, 255, n * size, dtype=np.uint8)
    dst = np.zeros_like(src)
    assert store.register_buffer(src.ctypes.data, src.nbytes) == 0
    assert store.register_buffer(dst.ctypes.data, dst.nbytes) == 0
    keys = [f"{key}-{i}" for i in range(n)]
    ptrs = [src.ctypes.data + i * size for i in range(n)]
    assert store.batch_put_from(keys, ptrs, [size] * n) == [0] * n
    out = [dst.ctypes.data + i * size for i in range(n)]
    assert store.batch_get_into(keys, out, [size] * n) == [size] * n
    assert np.array_equal(src, dst)
    # Single forms, and an object bigger than the destination.
    assert store.put_from(key, src.ctypes.data, 1000) == 0
    assert store.get_into(key, dst.ctypes.data, 1000) == 1000
    assert store.get_into(key, dst.ctypes.data, 999) == INVALID_PARAMS
    k2 = key + "-upsert"  # not leased yet
    assert store.put_from(k2, src.ctypes.data, 1000) == 0
    assert store.upsert_from(k2, src.ctypes.data + 7, 500) == 0
    assert store.batch_upsert_from([k2], [src.ctypes.data], [10]) == [0]
    assert store.get_into(k2, dst.ctypes.data, 1000) == 10
    assert bytes(dst[:10]) == bytes(src[:10])
    # Mismatched lengths: one negative code per key; empty batches are empty.
    assert all(r < 0 for r in store.batch_get_into(keys[:2], out[:1], [size]))
    assert all(r < 0 for r in store.batch_put_from(keys[:2], ptrs[:1], [size]))
    assert store.batch_get_into([], [], []) == []
    assert store.batch_get_into(["missing-" + key], [out[0]], [size]) == [NOT_FOUND]
    assert store.unregister_buffer(src.ctypes.data) == 0
    assert store.unregister_buffer(dst.ctypes.data) == 0
    assert store.unregister_buffer(dst.ctypes.data) < 0


def test_zero_copy_needs_registered_memory(store, key):
    a = np.ones(4096, dtype=np.uint8)
    assert store.put_from(key, a.ctypes.data, a.nbytes) == INVALID_PARAMS
    assert store.is_exist(key) == 0
    assert store.register_buffer(0, 10) == INVALID_PARAMS


def test_multi_buffer_variants(store, key):
    k = np.arange(1000, dtype=np.uint8)
    v = np.arange(1000, 2500, dtype=np.uint16).view(np.uint8)
    rc = store.batch_put_from_multi_buffers(
        [key], [[k.ctypes.data, v.ctypes.data]], [[k.nbytes, v.nbytes]]
    )
    assert rc == [0]
    assert store.get(key) == k.tobytes() + v.tobytes()
    k2, v2 = np.zeros_like(k), np.zeros_like(v)
    got = store.batch_get_into_multi_buffers(
        [key, "missing-" + key],
        [[k2.ctypes.data, v2.ctypes.data], [k2.ctypes.data]],
        [[k2.nbytes, v2.nbytes], [10]],
    )
    assert got == [k.nbytes + v.nbytes, NOT_FOUND]
    assert np.array_equal(k, k2) and np.array_equal(v, v2)


def test_remove_by_regex_remove_all_and_batch_remove(store, key):
    for i in range(4):
        assert store.put(f"{key}-re-{i}", b"x") == 0
    assert store.put(f"{key}-keep", b"x") == 0
    assert store.remove_by_regex(f"^{key}-re-[0-2]$") == 3
    assert store.batch_is_exist([f"{key}-re-{i}" for i in range(4)]) == [0, 0, 0, 1]
    assert store.remove_by_regex("([") == INVALID_PARAMS
    assert store.batch_remove([f"{key}-re-3"]) == [HAS_LEASE]  # batch_is_exist leased it
    assert store.batch_remove([f"{key}-re-3", f"{key}-re-3"], force=True) == [0, NOT_FOUND]
    assert store.is_exist(f"{key}-keep") == 1  # leased now
    assert store.remove_all() == 0  # leased objects stay
    time.sleep(LEASE_TTL_S + 0.3)
    assert store.remove_all() >= 1
    assert store.is_exist(f"{key}-keep") == 0


def test_replicate_config_fields_and_checks(store, key):
    c = ReplicateConfig()
    assert (c.replica_num, c.with_hard_pin, c.preferred_segment) == (1, False, "")
    assert c.soft_pin_action == SoftPinAction.PRESERVE and c.soft_pin_ttl_ms is None
    assert c.data_type == ObjectDataType.UNKNOWN and c.group_ids is None
    c.soft_pin_ttl_ms = 1000
    assert c.soft_pin_ttl_ms == 1000
    c.soft_pin_ttl_ms = None
    with pytest.raises(TypeError):
        c.soft_pin_ttl_ms = -1
    with pytest.raises(TypeError):
        c.soft_pin_ttl_ms = 1 << 64
    c.replica_num = 3
    assert "3" in str(c)

    enable = ReplicateConfig()
    enable.soft_pin_action = SoftPinAction.ENABLE
    enable.soft_pin_ttl_ms = 60_000
    assert store.put(key, b"soft", enable) == 0
    preserve_ttl = ReplicateConfig()
    preserve_ttl.soft_pin_ttl_ms = 1000
    assert store.upsert(key, b"x", preserve_ttl) == INVALID_PARAMS
    assert store.upsert(key, b"soft2") == 0

    hard = ReplicateConfig()
    hard.with_hard_pin = True
    assert store.put(key + "-hard", b"pinned", hard) == 0
    assert store.remove(key + "-hard") == HAS_LEASE  # a hard pin protects it like a lease
    assert store.remove(key + "-hard", force=True) == 0

    nof = ReplicateConfig()
    nof.nof_replica_num = 1
    assert store.put(key + "-nof", b"x", nof) == NOT_SUPPORTED
    groups = ReplicateConfig()
    groups.group_ids = ["a"]
    assert store.put_batch([key + "-g0", key + "-g1"], [b"0", b"1"], groups) == INVALID_PARAMS
    zero = ReplicateConfig()
    zero.replica_num = 0
    assert store.put(key + "-z", b"x", zero) == INVALID_PARAMS


def test_embedded_segment_preferred_and_close(cluster, key):
    """global_segment_size > 0 contributes this process's DRAM; close() takes it away."""
    owner = MooncakeDistributedStore()
    assert owner.setup("localhost", "P2PHANDSHAKE", 32 << 20, 16 << 20, "tcp", "", cluster.master) == 0
    reader = MooncakeDistributedStore()
    assert reader.setup("localhost", "P2PHANDSHAKE", 0, 16 << 20, "tcp", "", cluster.master) == 0
    try:
        assert owner.get_hostname() in cluster.segments()
        cfg = ReplicateConfig()
        cfg.preferred_segment = owner.get_hostname()
        assert owner.put(key, b"in the owner's segment", cfg) == 0
        with kvfs.Client(cluster.master) as c:
            reps = c.stat(key)["replicas"]
        assert [r["endpoint"] for r in reps] == [owner.get_hostname()]
        assert reader.get(key) == b"in the owner's segment"
        assert owner.close() == 0
        assert owner.get_hostname() not in cluster.segments()
        assert reader.get(key) == b""  # the segment left with its objects
    finally:
        owner.close()
        reader.close()


def test_local_buffer_size_bounds_staging(cluster, key):
    zero = MooncakeDistributedStore()
    assert zero.setup("localhost", "P2PHANDSHAKE", 0, 0, "tcp", "", cluster.master) == 0
    try:
        assert zero.put(key, b"needs staging") != 0
        assert zero.is_exist(key) == 0
        a = np.ones(4096, dtype=np.uint8)  # the zero-copy path does not stage
        assert zero.register_buffer(a.ctypes.data, a.nbytes) == 0
        assert zero.put_from(key, a.ctypes.data, a.nbytes) == 0
        assert zero.get(key) == b""  # but get does
    finally:
        zero.close()
    small = MooncakeDistributedStore()
    assert small.setup("localhost", "P2PHANDSHAKE", 0, "64KB", "tcp", "", cluster.master) == 0
    try:
        assert small.put(key + "-big", b"x" * (128 << 10)) == INVALID_PARAMS
        assert small.put(key + "-ok", b"x" * (64 << 10)) == 0
        # Values from 256 KiB move straight from and into the caller's objects: no staging.
        large = np.random.default_rng(7).integers(0, 255, 2 << 20, dtype=np.uint8).tobytes()
        assert small.put(key + "-large", large) == 0
        assert small.get(key + "-large") == large
        assert small.get_batch([key + "-large", key + "-ok"]) == [large, b"x" * (64 << 10)]
        huge = large * 12  # 24 MiB: striped over several connections
        assert small.put(key + "-huge", huge) == 0
        for _ in range(3):
            assert small.get(key + "-huge") == huge
    finally:
        small.close()


def test_setup_dummy_is_a_pure_client(cluster, key):
    s = MooncakeDistributedStore()
    assert s.setup_dummy(64 << 20, 16 << 20, cluster.master) == 0
    try:
        assert s.put(key, b"dummy") == 0
        assert s.get(key) == b"dummy"
    finally:
        s.remove(key, force=True)
        s.close()


def test_gil_is_released_during_io(cluster):
    """A call blocked on the network lets other Python threads run, and still ends."""
    import socket

    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(1)  # accepts, never answers
    addr = "127.0.0.1:%d" % silent.getsockname()[1]
    ticks, result = [], {}

    def blocked():
        try:
            kvfs.Client(addr, rpc_timeout_ms=1500, timeout_ms=3000)
        except kvfs.KvfsError as e:
            result["error"] = e

    t = threading.Thread(target=blocked)
    t0 = time.monotonic()
    t.start()
    while t.is_alive():
        ticks.append(time.monotonic())
        time.sleep(0.01)
    t.join()
    silent.close()
    assert isinstance(result.get("error"), (kvfs.UnavailableError, kvfs.TimeoutError))
    assert time.monotonic() - t0 < 10
    assert len(ticks) > 50  # the main thread ran all along


def test_two_processes_share_one_pool(cluster, key):
    """A second Python process (spawned) writes with its own embedded segment; this one reads,
    then writes for the child to read."""
    child = f"""
import sys, numpy as np
from mooncake.store import MooncakeDistributedStore, ReplicateConfig
s = MooncakeDistributedStore()
assert s.setup("localhost", "P2PHANDSHAKE", 16 << 20, 16 << 20, "tcp", "", "{cluster.master}") == 0
cfg = ReplicateConfig(); cfg.preferred_segment = s.get_hostname()
a = np.arange(1 << 20, dtype=np.uint8)
assert s.register_buffer(a.ctypes.data, a.nbytes) == 0
assert s.batch_put_from(["{key}-c0", "{key}-c1"], [a.ctypes.data, a.ctypes.data + 5], [1000, 2000]) == [0, 0]
assert s.put("{key}-bytes", b"from the child", cfg) == 0
print(s.get_hostname())
sys.stdout.flush()
line = sys.stdin.readline()  # wait for the parent's write
print(s.get("{key}-parent").decode())
s.close()
"""
    import subprocess
    import sys as _sys

    p = subprocess.Popen(
        [_sys.executable, "-c", child], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        child_host = p.stdout.readline().strip()
        assert child_host in cluster.segments()
        s = MooncakeDistributedStore()
        assert s.setup("localhost", "P2PHANDSHAKE", 0, 16 << 20, "tcp", "", cluster.master) == 0
        try:
            a = np.arange(1 << 20, dtype=np.uint8)
            assert s.get(f"{key}-c0") == a[:1000].tobytes()
            assert s.get(f"{key}-c1") == a[5:2005].tobytes()
            assert s.get(f"{key}-bytes") == b"from the child"
            node_cfg = ReplicateConfig()
            node_cfg.preferred_segment = [x for x in cluster.segments() if x != child_host][0]
            assert s.put(f"{key}-parent", b"from the parent", node_cfg) == 0
            out, _ = p.communicate("go\n", timeout=30)
            assert out.strip() == "from the parent"
            assert p.returncode == 0
            # The child closed: what lived in its segment is gone, the rest stays.
            assert s.get(f"{key}-bytes") == b""
            assert s.get(f"{key}-parent") == b"from the parent"
        finally:
            s.close()
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()


def test_import_shim_and_run_python_helper(cluster):
    out = run_python("import mooncake.store as m, kvfs.mooncake as k; print(m.MooncakeDistributedStore is k.MooncakeDistributedStore)")
    assert out.strip() == "True"


def test_rename_is_a_kvfs_extension_with_reference_codes(store, key):
    src, dst = key + "-src", key + "-dst"
    assert store.put(src, b"abc") == 0
    assert store.put(dst, b"xyz") == 0
    assert store.rename(src, dst, replace=False) == -705
    assert store.rename(src, dst) == 0
    assert store.get(dst) == b"abc"
    assert store.is_exist(src) == 0
    assert store.rename(src, dst) == -704
