"""The reference store's calls beyond the bytes and zero-copy API, against a real kvfs master
and node: replica descriptors, replica clearing, ranged reads, the host-memory allocator, NUMA
binding, the tensor calls in the reference's on-store format, the ``setup`` dict alias, and a
store leaving the pool when it is collected or its interpreter exits without ``close``."""

import ctypes
import gc
import os
import signal
import struct
import subprocess
import sys
import time

import numpy as np
import pytest

from conftest import LEASE_TTL_S, Cluster, run_python
from mooncake.store import (
    MooncakeDistributedStore,
    MooncakeHostMemAllocator,
    ReplicaStatus,
    ReplicateConfig,
)

NOT_FOUND = -704
INVALID_PARAMS = -600

# The reference's tensor object header, written out from its documented layout (not from
# kvfs._tensor, so these tests check kvfs against the format rather than against itself).
MAGIC = 0x4D4F4F4E
HEADER = struct.Struct("<IHHiiIIQQ8q8qII" + "iiiiiiq" * 4)
CODES = {"float32": 0, "float64": 1, "int8": 2, "uint8": 3, "int16": 4, "uint16": 5,
         "int32": 6, "uint32": 7, "int64": 8, "uint64": 9, "bool": 10, "float16": 11,
         "bfloat16": 12}


def ref_header(code, shape, nbytes, global_shape=None, axis=None):
    pad = lambda s: list(s) + [-1] * (8 - len(s))  # noqa: E731
    full = global_shape is None
    fields = [MAGIC, 1, 304, code, len(shape), 0 if full else 1, 0, 304, nbytes]
    fields += pad(shape if full else global_shape) + pad(shape)
    fields += [0 if axis is None else 1, 0]
    axes = [list(axis)] if axis is not None else []
    axes += [[0] * 7] * (4 - len(axes))
    for a in axes:
        fields += a
    return HEADER.pack(*fields)


def ref_object(a):
    return ref_header(CODES[a.dtype.name], a.shape, a.nbytes) + np.ascontiguousarray(a).tobytes()


def torch_or_none():
    try:
        import torch

        return torch
    except ImportError:
        return None


def as_numpy(t):
    torch = torch_or_none()
    if torch is not None and isinstance(t, torch.Tensor):
        return t.numpy()
    return t


# ----- setup ------------------------------------------------------------------------------


def test_setup_dict_accepts_lmcaches_master_server_address(cluster, key, caplog):
    s = MooncakeDistributedStore()
    cfg = {
        "local_hostname": "localhost",
        "metadata_server": "P2PHANDSHAKE",
        "global_segment_size": 0,
        "local_buffer_size": "16MB",
        "protocol": "tcp",
        "master_server_address": cluster.master,
    }
    with caplog.at_level("WARNING", logger="kvfs.mooncake"):
        assert s.setup(cfg) == 0
    try:
        assert "master_server_address" in caplog.text
        assert s.put(key, b"via the alias") == 0
        assert s.get(key) == b"via the alias"
        assert s.remove(key, force=True) == 0
    finally:
        s.close()
    # master_server_addr wins when both are given (the alias points nowhere here).
    both = dict(cfg, master_server_addr=cluster.master, master_server_address="127.0.0.1:1")
    s2 = MooncakeDistributedStore()
    assert s2.setup(both) == 0
    s2.close()


# ----- replica descriptors and clearing ---------------------------------------------------


def test_replica_descriptors_describe_where_the_bytes_are(cluster, store, key):
    data = b"x" * 1000
    assert store.put(key, data) == 0
    descs = store.get_replica_desc(key)
    assert len(descs) == 1
    d = descs[0]
    assert d.status == ReplicaStatus.COMPLETE
    assert d.is_memory_replica() and not d.is_disk_replica() and not d.is_local_disk_replica()
    buf = d.get_memory_descriptor().buffer_descriptor
    assert buf.size == len(data) and buf.buffer_address != 0
    assert buf.transport_endpoint in cluster.segments()
    assert "transport_endpoint=" in repr(buf)
    with pytest.raises(RuntimeError):
        d.get_disk_descriptor()
    assert store.get_replica_desc("missing-" + key) == []
    got = store.batch_get_replica_desc([key, "missing-" + key])
    assert list(got) == [key]
    assert got[key][0].get_memory_descriptor().buffer_descriptor.size == len(data)
    # No lease was granted: a plain remove works at once.
    assert store.remove(key) == 0
    assert MooncakeDistributedStore().get_replica_desc(key) == []  # not set up


def test_replica_descriptors_of_two_replicas(cluster, key):
    owner = MooncakeDistributedStore()
    assert owner.setup("localhost", "P2PHANDSHAKE", 32 << 20, 16 << 20, "tcp", "", cluster.master) == 0
    try:
        cfg = ReplicateConfig()
        cfg.replica_num = 2
        assert owner.put(key, b"twice", cfg) == 0
        endpoints = {
            d.get_memory_descriptor().buffer_descriptor.transport_endpoint
            for d in owner.get_replica_desc(key)
        }
        assert len(endpoints) == 2 and owner.get_hostname() in endpoints
        # Clearing by segment drops only that segment's copy; the other still serves reads.
        time.sleep(LEASE_TTL_S + 0.3)  # past the lease the put granted
        assert owner.batch_replica_clear([key], segment_name=owner.get_hostname()) == [key]
        left = [d.get_memory_descriptor().buffer_descriptor.transport_endpoint
                for d in owner.get_replica_desc(key)]
        assert left == [e for e in endpoints if e != owner.get_hostname()]
        assert owner.get(key) == b"twice"
    finally:
        owner.remove(key, force=True)
        owner.close()


def test_batch_replica_clear_skips_leased_and_missing_keys(store, key):
    keys = [f"{key}-{i}" for i in range(3)]
    for k in keys:
        assert store.put(k, b"clear me") == 0
    assert store.batch_replica_clear([]) == []
    assert store.batch_replica_clear(keys) == [], "a fresh put counts as leased, as there"
    time.sleep(LEASE_TTL_S + 0.3)
    assert store.get(keys[0]) == b"clear me"  # a read lease on keys[0]
    cleared = store.batch_replica_clear(keys + ["missing-" + key])
    assert sorted(cleared) == keys[1:]
    assert store.get(keys[1]) == b"" and store.is_exist(keys[2]) == 0
    assert store.get(keys[0]) == b"clear me"
    time.sleep(LEASE_TTL_S + 0.3)
    assert store.batch_replica_clear([keys[0]], segment_name="nowhere:1") == []
    node = store.get_replica_desc(keys[0])[0].endpoint
    assert store.batch_replica_clear([keys[0], keys[0]], segment_name=node) == [keys[0]]
    assert store.is_exist(keys[0]) == 0


def test_batch_replica_clear_keeps_hard_pinned_objects(store, key):
    hard = ReplicateConfig()
    hard.with_hard_pin = True
    assert store.put(key, b"pinned", hard) == 0
    assert store.batch_replica_clear([key]) == []
    assert store.remove(key, force=True) == 0


# ----- ranged reads ------------------------------------------------------------------------


def test_get_into_ranges_follows_the_references_example(store, key):
    k1, k2 = key + "-1", key + "-2"
    v1, v2 = bytes(range(40)), bytes(range(100, 140))
    assert store.put(k1, v1) == 0 and store.put(k2, v2) == 0
    b0, b1 = np.zeros(32, dtype=np.uint8), np.zeros(32, dtype=np.uint8)
    assert store.register_buffer(b0.ctypes.data, 32) == 0
    assert store.register_buffer(b1.ctypes.data, 32) == 0
    try:
        results = store.get_into_ranges(
            [b0.ctypes.data, b1.ctypes.data],
            [[k1, k2], [k2, k1]],
            [[[0, 20], [8]], [[4], [16]]],
            [[[1, 30], [2]], [[0], [10]]],
            [[[4, 3], [5]], [[6], [4]]],
        )
        assert results == [[[4, 3], [5]], [[6], [4]]]
        assert bytes(b0[0:4]) == v1[1:5] and bytes(b0[20:23]) == v1[30:33]
        assert bytes(b0[8:13]) == v2[2:7]
        assert bytes(b1[4:10]) == v2[0:6] and bytes(b1[16:20]) == v1[10:14]
        assert not b0[4:8].any() and not b1[0:4].any()

        # Per-fragment failures next to successes.
        results = store.get_into_ranges(
            [b0.ctypes.data],
            [[k1, "missing-" + key, k2]],
            [[[0, 30, 0], [0], [28]]],
            [[[0, 0, 39], [0], [0]]],
            [[[2, 8, 2], [1], [0]]],
        )
        # k1: ok; past the registered buffer (30 + 8 > 32); past the object (39 + 2 > 40).
        assert results == [[[2, INVALID_PARAMS, INVALID_PARAMS], [NOT_FOUND], [0]]]

        # Shape errors: a key whose fragment lists differ, a whole row, the top level.
        assert store.get_into_ranges([b0.ctypes.data], [[k1]], [[[0, 1]]], [[[0]]], [[[1]]]) == [
            [[INVALID_PARAMS, INVALID_PARAMS]]
        ]
        assert store.get_into_ranges([b0.ctypes.data], [[k1, k2]], [[[0]]], [[[0]]], [[[1]]]) == [
            [[INVALID_PARAMS], [INVALID_PARAMS]]
        ]
        assert store.get_into_ranges([b0.ctypes.data, b1.ctypes.data], [[k1]], [], [], []) == [
            [[INVALID_PARAMS]],
            [[INVALID_PARAMS]],
        ]
        assert store.get_into_ranges([], [], [], [], []) == []
        # Unregistered memory is refused.
        loose = np.zeros(16, dtype=np.uint8)
        assert store.get_into_ranges([loose.ctypes.data], [[k1]], [[[0]]], [[[0]]], [[[4]]]) == [
            [[INVALID_PARAMS]]
        ]
        assert not loose.any()
    finally:
        store.unregister_buffer(b0.ctypes.data)
        store.unregister_buffer(b1.ctypes.data)


def test_get_into_ranges_reads_an_embedded_segment_and_large_ranges(cluster, store, key):
    owner = MooncakeDistributedStore()
    assert owner.setup("localhost", "P2PHANDSHAKE", 32 << 20, 16 << 20, "tcp", "", cluster.master) == 0
    try:
        data = np.random.default_rng(3).integers(0, 255, 3 << 20, dtype=np.uint8)
        cfg = ReplicateConfig()
        cfg.preferred_segment = owner.get_hostname()
        assert owner.put(key, data, cfg) == 0
        dst = np.zeros(2 << 20, dtype=np.uint8)
        for reader in (owner, store):  # same process's segment, and through the engine
            dst[:] = 0
            assert reader.register_buffer(dst.ctypes.data, dst.nbytes) == 0
            try:
                r = reader.get_into_ranges(
                    [dst.ctypes.data], [[key]], [[[0, 1 << 20]]], [[[5, 2 << 20]]],
                    [[[1 << 20, 1 << 20]]],
                )
            finally:
                reader.unregister_buffer(dst.ctypes.data)
            assert r == [[[1 << 20, 1 << 20]]]
            assert np.array_equal(dst[: 1 << 20], data[5 : 5 + (1 << 20)])
            assert np.array_equal(dst[1 << 20 :], data[2 << 20 : 3 << 20])
        assert MooncakeDistributedStore().get_into_ranges(
            [dst.ctypes.data], [[key]], [[[0]]], [[[0]]], [[[1]]]
        ) == [[[INVALID_PARAMS]]]  # not set up
    finally:
        owner.remove(key, force=True)
        owner.close()


# ----- host memory and NUMA ---------------------------------------------------------------


def test_host_mem_allocator_memory_serves_zero_copy_calls(store, key):
    alloc = MooncakeHostMemAllocator()
    size = 1 << 20
    ptr = alloc.alloc(size)
    assert ptr != 0 and ptr % 4096 == 0
    mem = np.ctypeslib.as_array((ctypes.c_ubyte * size).from_address(ptr))
    assert not mem.any()
    mem[:] = np.arange(size, dtype=np.uint64).astype(np.uint8)
    assert store.register_buffer(ptr, size) == 0
    try:
        assert store.put_from(key, ptr, size) == 0
        assert store.get(key) == mem.tobytes()
        mem[:] = 0
        assert store.get_into(key, ptr, size) == size
        assert np.array_equal(mem, np.arange(size, dtype=np.uint64).astype(np.uint8))
    finally:
        assert store.unregister_buffer(ptr) == 0
    del mem
    assert MooncakeHostMemAllocator().free(ptr) == 0  # one table for the process
    assert alloc.free(ptr) == -1
    assert alloc.free(12345) == -1
    with pytest.raises(RuntimeError):
        alloc.alloc(0)


def test_no_local_buffer_means_no_bytes_puts_but_zero_copy_puts_work(cluster, key):
    """The reference's test_zero_local_buffer_size: with local_buffer_size 0 bytes puts fail
    (INVALID_PARAMS) and leave nothing, even into this process's own segment; the zero-copy
    calls on registered memory need no buffer and work."""
    s = MooncakeDistributedStore()
    assert s.setup("localhost", "P2PHANDSHAKE", 16 << 20, 0, "tcp", "", cluster.master) == 0
    try:
        assert s.put(key, b"value") == INVALID_PARAMS
        assert s.put_batch([key], [b"value"]) == INVALID_PARAMS
        assert s.put_parts(key, b"val", b"ue") == INVALID_PARAMS
        assert s.is_exist(key) == 0
        src = np.frombuffer(b"zero-copy value", dtype=np.uint8).copy()
        dst = np.zeros_like(src)
        assert s.register_buffer(src.ctypes.data, src.nbytes) == 0
        assert s.register_buffer(dst.ctypes.data, dst.nbytes) == 0
        try:
            assert s.put_from(key, src.ctypes.data, src.nbytes) == 0
            assert s.get_into(key, dst.ctypes.data, dst.nbytes) == dst.nbytes
            assert dst.tobytes() == b"zero-copy value"
        finally:
            s.unregister_buffer(src.ctypes.data)
            s.unregister_buffer(dst.ctypes.data)
        s.remove(key, force=True)
    finally:
        s.close()


def test_bind_to_numa_node_binds_the_calling_thread():
    node0 = "/sys/devices/system/node/node0/cpulist"
    if not os.path.exists(node0):
        pytest.skip("no NUMA topology in sysfs")
    out = run_python(
        """
import os
from mooncake.store import bind_to_numa_node
before = os.sched_getaffinity(0)
assert bind_to_numa_node(10 ** 6) is None  # invalid: a warning, nothing changes
assert os.sched_getaffinity(0) == before
bind_to_numa_node(0)
print(sorted(os.sched_getaffinity(0)))
"""
    )
    cpus = set()
    for part in open(node0).read().strip().split(","):
        lo, _, hi = part.partition("-")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    assert out.strip() == str(sorted(cpus))


# ----- tensors ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "a",
    [
        np.arange(24, dtype=np.float32).reshape(2, 3, 4),
        np.linspace(-1, 1, 15, dtype=np.float16).reshape(5, 3),
        np.arange(-5, 5, dtype=np.int64),
        np.array([True, False, True]),
        np.array(7, dtype=np.uint8),
        np.zeros((0, 3), dtype=np.int32),
        np.arange(12, dtype=np.float64).reshape(3, 4).T,  # not contiguous: stored in C order
        np.arange(6, dtype=">i4"),  # big-endian: stored little-endian
    ],
    ids=["f32-3d", "f16", "i64", "bool", "u8-scalar", "empty", "transposed", "big-endian"],
)
def test_put_tensor_writes_the_references_format(store, key, a):
    assert store.put_tensor(key, a) == 0
    native = a.astype(a.dtype.newbyteorder("="))
    assert store.get(key) == ref_object(native)
    back = as_numpy(store.get_tensor(key))
    assert back.dtype == native.dtype and back.shape == a.shape
    assert np.array_equal(back, a)
    assert back.flags.writeable


def test_tensors_in_the_references_format_read_back(store, key):
    a = np.arange(10, dtype=np.int16).reshape(2, 5)
    assert store.put(key, ref_object(a)) == 0  # as a reference store would have written it
    assert np.array_equal(as_numpy(store.get_tensor(key)), a)
    # bfloat16 (1.0, -2.0): torch gives bfloat16, numpy without ml_dtypes its raw uint16 bits.
    raw = np.array([0x3F80, 0xC000], dtype=np.uint16)
    assert store.put(key + "-bf16", ref_header(12, (2,), 4) + raw.tobytes()) == 0
    got = store.get_tensor(key + "-bf16")
    torch = torch_or_none()
    if torch is not None:
        assert got.dtype == torch.bfloat16 and got.float().tolist() == [1.0, -2.0]
    else:
        assert got.dtype == np.uint16 and got.tolist() == raw.tolist()


def test_get_tensor_refuses_what_is_not_a_tensor(store, key):
    assert store.get_tensor("missing-" + key) is None
    assert store.put(key, b"not a tensor" * 40) == 0
    assert store.get_tensor(key) is None
    a = np.arange(4, dtype=np.float32)
    assert store.put(key + "-short", ref_object(a)[:-4]) == 0  # shorter than its header says
    assert store.get_tensor(key + "-short") is None
    assert store.put_tensor(key + "-list", [1, 2, 3]) == INVALID_PARAMS
    assert store.put_tensor(key + "-complex", np.ones(2, dtype=np.complex64)) == INVALID_PARAMS
    assert store.put_tensor(key + "-9d", np.ones((1,) * 9, dtype=np.uint8)) == INVALID_PARAMS
    assert MooncakeDistributedStore().put_tensor(key, a) == INVALID_PARAMS  # not set up
    assert MooncakeDistributedStore().get_tensor(key) is None


def test_batch_tensor_calls(store, key):
    keys = [f"{key}-{i}" for i in range(5)]
    arrays = [np.full((i + 1, 3), i, dtype=np.float32) for i in range(5)]
    assert store.batch_put_tensor(keys, arrays) == [0] * 5
    got = store.batch_get_tensor(keys + ["missing-" + key])
    assert got[-1] is None
    for a, g in zip(arrays, got[:-1]):
        assert np.array_equal(as_numpy(g), a)
    assert store.batch_put_tensor(keys, arrays[:2]) == [INVALID_PARAMS] * 5
    assert store.batch_put_tensor([], []) == []
    assert store.batch_get_tensor([]) == []
    mixed = store.batch_put_tensor([key + "-ok", key + "-bad"], [arrays[0], "nope"])
    assert mixed == [0, INVALID_PARAMS]


def test_upsert_and_pub_tensor(store, key):
    a, b = np.zeros(8, dtype=np.int32), np.ones((2, 2), dtype=np.uint8)
    assert store.put_tensor(key, a) == 0
    assert store.put_tensor(key, b) == 0  # first writer wins
    assert np.array_equal(as_numpy(store.get_tensor(key)), a)
    time.sleep(LEASE_TTL_S + 0.3)  # the get leased it
    assert store.upsert_tensor(key, b) == 0
    assert np.array_equal(as_numpy(store.get_tensor(key)), b)
    cfg = ReplicateConfig()
    cfg.with_hard_pin = True
    assert store.pub_tensor(key + "-pub", a, cfg) == 0
    assert store.remove(key + "-pub") < 0  # hard-pinned
    assert store.batch_pub_tensor([key + "-p0", key + "-p1"], [a, b], cfg) == [0, 0]
    zero = ReplicateConfig()
    zero.replica_num = 0
    assert store.pub_tensor(key + "-zero", a, zero) == INVALID_PARAMS
    assert store.batch_upsert_pub_tensor([key + "-u"], [a]) == [0]
    assert store.upsert_pub_tensor(key + "-u", b) == 0
    assert np.array_equal(as_numpy(store.get_tensor(key + "-u")), b)


def test_tensor_parallel_shards(store, key):
    a = np.arange(24, dtype=np.float32).reshape(4, 6)
    assert store.put_tensor_with_tp(key, a, tp_size=3, split_dim=1) == 0
    assert store.get(key) == b""  # only the shards are stored
    for rank in range(3):
        shard = a[:, 2 * rank : 2 * rank + 2]
        expected = ref_header(0, (4, 2), shard.nbytes, global_shape=(4, 6),
                              axis=(1, 0, rank, 3, 1, 0, 2))
        assert store.get(f"{key}_tp_{rank}") == expected + shard.tobytes()
        got = store.get_tensor_with_tp(key, tp_rank=rank, tp_size=3, split_dim=1)
        assert np.array_equal(as_numpy(got), shard)
    assert store.put_tensor_with_tp(key + "-odd", a, tp_size=4, split_dim=1) == INVALID_PARAMS
    assert store.put_tensor_with_tp(key + "-dim", a, tp_size=2, split_dim=2) == INVALID_PARAMS
    assert store.put_tensor_with_tp(key + "-one", a, tp_size=1) == 0
    assert np.array_equal(as_numpy(store.get_tensor_with_tp(key + "-one")), a)

    base = [key + "-b0", key + "-b1", key + "-b2"]
    ts = [a, a * 2, np.ones((3, 3), dtype=np.float32)]  # the last one does not divide by 2
    assert store.batch_put_tensor_with_tp(base, ts, tp_size=2) == [0, 0, INVALID_PARAMS]
    got = store.batch_get_tensor_with_tp(base, tp_rank=1, tp_size=2)
    assert np.array_equal(as_numpy(got[0]), a[2:]) and np.array_equal(as_numpy(got[1]), 2 * a[2:])
    assert got[2] is None
    assert store.batch_put_tensor_with_tp(base, ts[:1], tp_size=2) == [INVALID_PARAMS] * 3
    groups = ReplicateConfig()
    groups.group_ids = ["g0", "g1"]
    assert store.batch_pub_tensor_with_tp(base[:2], ts[:2], groups, tp_size=2) == [0, 0]


def test_tensor_into_and_from_registered_memory(store, key):
    a = np.arange(300, dtype=np.int32).reshape(10, 30)
    buf = np.zeros(304 + a.nbytes + 100, dtype=np.uint8)
    ptr = buf.ctypes.data
    assert store.register_buffer(ptr, buf.nbytes) == 0
    try:
        assert store.put_tensor(key, a) == 0
        t = store.get_tensor_into(key, ptr, buf.nbytes)
        arr = as_numpy(t)
        assert np.array_equal(arr, a)
        assert arr.__array_interface__["data"][0] == ptr + 304  # a view of the buffer
        buf[304:308] = np.frombuffer(np.int32(-9).tobytes(), dtype=np.uint8)
        assert arr[0, 0] == -9
        assert store.get_tensor_into("missing-" + key, ptr, buf.nbytes) is None
        assert store.get_tensor_into(key, ptr, 100) is None  # buffer too small
        assert store.get_tensor_into(key, 0, 100) is None

        # The buffer now holds [header][payload] (with a[0,0] = -9): store it without a copy.
        n = 304 + a.nbytes
        assert store.put_tensor_from(key + "-from", ptr, n) == 0
        b = a.copy()
        b[0, 0] = -9
        assert np.array_equal(as_numpy(store.get_tensor(key + "-from")), b)
        assert store.put_tensor_from(key + "-x", ptr, n - 4) == INVALID_PARAMS  # sizes disagree
        assert store.put_tensor_from(key + "-x", ptr, 100) == INVALID_PARAMS
        assert store.put_tensor_from(key + "-x", 0, n) == INVALID_PARAMS
        assert store.batch_put_tensor_from([key + "-f0", key + "-f1"], [ptr, ptr], [n, n]) == [0, 0]
        assert store.batch_put_tensor_from([key + "-f2", key + "-f3"], [ptr, ptr], [n, 5]) == [
            INVALID_PARAMS
        ] * 2
        assert store.batch_put_tensor_from([], [], []) == []
        assert store.upsert_tensor_from(key + "-f0", ptr, n) == 0
        assert store.batch_upsert_tensor_from([key + "-f1"], [ptr], [n]) == [0]

        # Tensor-parallel puts from a full tensor in memory, reads of shards into memory.
        assert store.put_tensor_with_tp_from(key + "-tp", ptr, n, tp_size=2, split_dim=1) == 0
        out = np.zeros(304 + a.nbytes // 2, dtype=np.uint8)
        assert store.register_buffer(out.ctypes.data, out.nbytes) == 0
        try:
            s1 = store.get_tensor_with_tp_into(key + "-tp", out.ctypes.data, out.nbytes,
                                               tp_rank=1, tp_size=2, split_dim=1)
            assert np.array_equal(as_numpy(s1), b[:, 15:])
            got = store.batch_get_tensor_with_tp_into(
                [key + "-tp", "missing-" + key], [out.ctypes.data, out.ctypes.data],
                [out.nbytes, out.nbytes], tp_rank=0, tp_size=2,
            )
            assert np.array_equal(as_numpy(got[0]), b[:, :15]) and got[1] is None
        finally:
            store.unregister_buffer(out.ctypes.data)
        assert store.batch_put_tensor_with_tp_from(
            [key + "-tp2", key + "-tp3"], [ptr, ptr], [n, 10], tp_size=2, split_dim=1
        ) == [0, INVALID_PARAMS]
        got = store.batch_get_tensor_into([key + "-from"], [ptr], [buf.nbytes])
        assert np.array_equal(as_numpy(got[0]), b)
        assert store.batch_get_tensor_into([key], [ptr, ptr], [1]) == [INVALID_PARAMS]
        assert store.batch_get_tensor_into([key], [0], [buf.nbytes]) == [INVALID_PARAMS]
    finally:
        store.unregister_buffer(ptr)


def test_tensor_calls_use_torch_where_it_is_installed(store, key):
    torch = pytest.importorskip("torch")
    t = torch.arange(12, dtype=torch.bfloat16).reshape(3, 4)
    assert store.put_tensor(key, t) == 0
    raw = t.view(torch.int16).numpy().tobytes()
    assert store.get(key) == ref_header(12, (3, 4), 24) + raw
    back = store.get_tensor(key)
    assert isinstance(back, torch.Tensor) and back.dtype == torch.bfloat16
    assert torch.equal(back, t)
    assert store.put_tensor(key + "-np", np.arange(3, dtype=np.float32)) == 0
    assert isinstance(store.get_tensor(key + "-np"), torch.Tensor)
    grad = torch.ones(4, 4, requires_grad=True) * 2
    assert store.put_tensor_with_tp(key + "-tp", grad, tp_size=2, split_dim=0) == 0
    assert torch.equal(store.get_tensor_with_tp(key + "-tp", 1, 2), torch.full((2, 4), 2.0))
    assert store.put_tensor(key + "-t", t.t()) == 0  # non-contiguous
    assert torch.equal(store.get_tensor(key + "-t"), t.t().contiguous())


def test_tensor_calls_fall_back_to_numpy_without_torch(cluster, key):
    out = run_python(
        f"""
import sys
sys.modules["torch"] = None  # as if torch were not installed
import numpy as np
from mooncake.store import MooncakeDistributedStore
s = MooncakeDistributedStore()
assert s.setup("localhost", "P2PHANDSHAKE", 0, 16 << 20, "tcp", "", "{cluster.master}") == 0
a = np.arange(6, dtype=np.float64).reshape(2, 3)
assert s.put_tensor("{key}", a) == 0
t = s.get_tensor("{key}")
print(type(t).__name__, t.dtype, t.tolist())
s.remove("{key}", force=True)
s.close()
"""
    )
    assert out.strip() == "ndarray float64 [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]]"


# ----- leaving the pool without close ------------------------------------------------------


def test_a_collected_store_leaves_the_pool(cluster, key):
    s = MooncakeDistributedStore()
    assert s.setup("localhost", "P2PHANDSHAKE", 16 << 20, 16 << 20, "tcp", "", cluster.master) == 0
    host = s.get_hostname()
    cfg = ReplicateConfig()
    cfg.preferred_segment = host
    assert s.put(key, b"in the collected store's segment", cfg) == 0
    assert host in cluster.segments()
    t0 = time.monotonic()
    del s
    gc.collect()
    # Gone at once, not after the master's node TTL (--client_ttl=3 here).
    assert host not in cluster.segments()
    assert time.monotonic() - t0 < 2.5
    reader = MooncakeDistributedStore()
    assert reader.setup("localhost", "P2PHANDSHAKE", 0, 16 << 20, "tcp", "", cluster.master) == 0
    try:
        assert reader.get(key) == b""
    finally:
        reader.close()


def test_an_interpreter_exiting_without_close_leaves_the_pool(cluster, key):
    child = f"""
import ctypes
from mooncake.store import MooncakeDistributedStore, ReplicateConfig
stores = []
for _ in range(2):
    s = MooncakeDistributedStore()
    assert s.setup("localhost", "P2PHANDSHAKE", 16 << 20, 16 << 20, "tcp", "", "{cluster.master}") == 0
    stores.append(s)
cfg = ReplicateConfig(); cfg.preferred_segment = stores[0].get_hostname()
assert stores[0].put("{key}", b"left behind", cfg) == 0
# The first store is never destroyed (a leaked reference, as an object kept by a cycle or a
# daemon thread at exit is): only the atexit hook can close it. The second one is destroyed
# when the interpreter clears this module.
ctypes.pythonapi.Py_IncRef(ctypes.py_object(stores[0]))
print(" ".join(s.get_hostname() for s in stores))
"""
    hosts = run_python(child).split()
    assert len(hosts) == 2
    segments = cluster.segments()
    assert not any(h in segments for h in hosts)
    reader = MooncakeDistributedStore()
    assert reader.setup("localhost", "P2PHANDSHAKE", 0, 16 << 20, "tcp", "", cluster.master) == 0
    try:
        assert reader.get(key) == b""
    finally:
        reader.close()


def test_exit_is_bounded_when_the_master_is_gone(tmp_path):
    lone = Cluster(str(tmp_path))
    try:
        lone.start_master()
        child = f"""
import sys
from mooncake.store import MooncakeDistributedStore
s = MooncakeDistributedStore()
assert s.setup("localhost", "P2PHANDSHAKE", 16 << 20, 16 << 20, "tcp", "", "{lone.master}") == 0
print("up"); sys.stdout.flush()
sys.stdin.readline()
"""
        p = subprocess.Popen(
            [sys.executable, "-c", child], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        try:
            assert p.stdout.readline().strip() == "up"
            master = lone.procs[0]
            master.send_signal(signal.SIGSTOP)  # silent: connections stay open, nothing answers
            t0 = time.monotonic()
            p.stdin.write("exit\n")
            p.stdin.flush()
            assert p.wait(timeout=30) == 0
            assert time.monotonic() - t0 < 10  # the exit budget (5 s) and a margin
            master.send_signal(signal.SIGCONT)
        finally:
            if p.poll() is None:
                p.kill()
                p.wait()
    finally:
        for proc in lone.procs:
            proc.send_signal(signal.SIGCONT)
        lone.stop()



def test_a_call_outliving_close_lets_other_threads_run_while_its_node_leaves(tmp_path):
    """A call in flight on one thread while another closes the store ends holding the last
    reference; its embedded node then leaves a master that does not answer (up to the leave
    timeout, 3 s). That wait must not hold the GIL: a ticking thread keeps ticking."""
    import threading

    lone = Cluster(str(tmp_path))
    try:
        lone.start_master()
        s = MooncakeDistributedStore()
        assert s.setup("localhost", "P2PHANDSHAKE", 16 << 20, 16 << 20, "tcp", "", lone.master) == 0
        ticks, done = [], threading.Event()

        def ticker():
            while not done.is_set():
                ticks.append(time.monotonic())
                time.sleep(0.01)

        got = {}
        tick = threading.Thread(target=ticker)
        tick.start()
        lone.procs[0].send_signal(signal.SIGSTOP)  # silent: nothing answers
        call = threading.Thread(target=lambda: got.update(r=s.is_exist("nobody")))
        call.start()
        time.sleep(0.3)
        s.close()  # the call still holds the session: it ends with the last reference
        call.join(timeout=60)
        time.sleep(0.2)
        done.set()
        tick.join()
        assert not call.is_alive() and got["r"] < 0
        gaps = [b - a for a, b in zip(ticks, ticks[1:])]
        # Held, the GIL froze every thread for the whole leave timeout (3.0 s measured).
        assert max(gaps) < 1.5, f"the interpreter stalled {max(gaps):.2f} s"
    finally:
        for proc in lone.procs:
            proc.send_signal(signal.SIGCONT)
        lone.stop()

def test_alloc_from_mem_pool_serves_zero_copy_calls(store, key):
    size = 3 << 20
    ptr = store.alloc_from_mem_pool(size)
    assert ptr != 0
    mem = np.ctypeslib.as_array((ctypes.c_ubyte * size).from_address(ptr))
    mem[:] = 7
    assert store.register_buffer(ptr, size) == 0, "registered by the caller, as the reference"
    try:
        assert store.batch_put_from([key + "a", key + "b"], [ptr, ptr + (1 << 20)],
                                    [1 << 20, 4096]) == [0, 0]
        assert store.get(key + "b") == b"\x07" * 4096
    finally:
        assert store.unregister_buffer(ptr) == 0
    assert store.alloc_from_mem_pool(0) == 0


def test_parallelism_calls_store_whole_tensors_and_refuse_layouts(store, key):
    a = np.arange(24, dtype=np.float32).reshape(4, 6)
    assert store.put_tensor_with_parallelism(key, a) == 0
    assert np.array_equal(np.asarray(store.get_tensor_with_parallelism(key)), a)
    assert store.get(key) == ref_object(a), "stored as put_tensor stores it"
    assert store.batch_put_tensor_with_parallelism([key + "1", key + "2"], [a, a + 1]) == [0, 0]
    got = store.batch_get_tensor_with_parallelism([key + "1", key + "2"])
    assert np.array_equal(np.asarray(got[1]), a + 1)
    assert store.upsert_tensor_with_parallelism(key + "u", a * 2) == 0  # unread: no lease
    assert np.array_equal(np.asarray(store.get_tensor(key + "u")), a * 2)
    # a named layout is a clear refusal (NOT_SUPPORTED), never a silent whole-tensor write
    assert store.put_tensor_with_parallelism(key + "x", a, parallelism=object()) == -1012
    refused = store.batch_put_tensor_with_parallelism([key + "y"], [a], writer_partitions=[1])
    assert refused == [-1012]
    assert store.is_exist(key + "x") == 0


def test_safetensors_export_and_import(store, key, tmp_path):
    pytest.importorskip("safetensors")
    torch = pytest.importorskip("torch")
    t = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    assert store.put_tensor(key, t) == 0
    path = str(tmp_path / "t.safetensors")
    assert store.save_tensor_to_safetensor(key, path) == 0
    assert store.save_tensor_to_safetensor(key + "missing", path) == -1100
    back = store.load_tensor_from_safetensor(key + "copy", path)
    assert torch.equal(back, t) and torch.equal(store.get_tensor(key + "copy"), t)
    assert store.load_tensor_from_safetensor(key, str(tmp_path / "nope")) is None
