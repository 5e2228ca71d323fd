"""LMCache 0.5.6's real ``MooncakestoreConnector`` on kvfs.

The class is ``lmcache.v1.storage_backend.connector.mooncakestore_connector.MooncakestoreConnector``
(what ``remote_url: mooncakestore://...`` selects), built exactly as LMCache's
``MooncakestoreConnectorAdapter`` builds it: ``(loop, local_cpu_backend, lmcache_config)``,
over a real ``LocalCPUBackend`` (LMCache picks its CPU stub device here) whose pinned buffer the
connector registers. Nothing is patched. Both of LMCache's data paths are driven:

* ``save_chunk_meta=True`` (LMCache's default): ``put_parts(key, 28-byte header, kv)`` and
  ``batch_get_buffer``;
* ``save_chunk_meta=False``: zero copy, ``put_from`` / ``batch_put_from`` from the registered
  buffer and ``batch_get_into`` into it (partial chunks come back shorter and are reshaped).

LMCache ignores the return codes of its puts (a put that fails or runs past
``transfer_timeout`` only logs), so every put here is checked by an existence query after it.

Config note: LMCache 0.5.6 hands ``store.setup`` a dict whose master key is
``master_server_address``; the reference's dict key is ``master_server_addr`` (kvfs reads the
same key), so the address is also passed as LMCache's ``mooncake_master_server_addr`` (its
documented ``mooncake_`` prefix forwards keys verbatim), else the client would go to the
default 127.0.0.1:50051.
"""

import asyncio
import ctypes
import hashlib
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from _common import LEASE_TTL_S, Child, MIB, child_main, emit, master_addr, pattern, wait_for_quit  # noqa: E402

if __name__ != "__main__":
    import pytest

    pytest.importorskip("lmcache.v1.storage_backend.connector.mooncakestore_connector")

import torch  # noqa: E402
from lmcache.utils import CacheEngineKey  # noqa: E402
from lmcache.v1.config import LMCacheEngineConfig  # noqa: E402
from lmcache.v1.metadata import LMCacheMetadata  # noqa: E402
from lmcache.v1.storage_backend.connector.mooncakestore_connector import (  # noqa: E402
    MooncakestoreConnector,
)
from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend  # noqa: E402

CHUNK = 16  # tokens per LMCache chunk
LAYERS, HEADS, HEAD = 2, 4, 32
DTYPE = torch.bfloat16
TOKEN_BYTES = 2 * LAYERS * HEADS * HEAD * 2  # K and V, all layers, bf16
SCRIPT = os.path.abspath(__file__)


class LMCacheDriver:
    """One engine process's LMCache remote backend: LocalCPUBackend + MooncakestoreConnector."""

    def __init__(self, segment_bytes=0, save_chunk_meta=True, transfer_timeout=1):
        master = master_addr()
        extra = {
            "local_hostname": "127.0.0.1",
            "metadata_server": "P2PHANDSHAKE",
            "master_server_address": master,
            "mooncake_master_server_addr": master,
            "global_segment_size": segment_bytes,
            "local_buffer_size": 32 * MIB,
            "protocol": "tcp",
            "device_name": "",
            "transfer_timeout": transfer_timeout,
            "save_chunk_meta": save_chunk_meta,
        }
        self.config = LMCacheEngineConfig.from_defaults(
            chunk_size=CHUNK,
            local_cpu=True,
            max_local_cpu_size=0.05,
            lmcache_instance_id=f"kvfs-engines-{os.getpid()}",
            remote_url=f"mooncakestore://{master}/",
            extra_config=extra,
        )
        metadata = LMCacheMetadata(
            model_name="kvfs-test-model",
            world_size=1,
            local_world_size=1,
            worker_id=0,
            local_worker_id=0,
            kv_dtype=DTYPE,
            kv_shape=(LAYERS, 2, CHUNK, HEADS, HEAD),
            chunk_size=CHUNK,
        )
        self.backend = LocalCPUBackend(self.config, metadata)
        self.loop = asyncio.new_event_loop()
        self.conn = MooncakestoreConnector(self.loop, self.backend, self.config)
        assert self.conn.registered_buffer_ptr is not None, "the pinned buffer was not registered"
        assert self.conn.save_chunk_meta is save_chunk_meta

    def run(self, coro):
        return self.loop.run_until_complete(coro)

    @staticmethod
    def key(tag, i):
        h = int.from_bytes(hashlib.blake2b(f"{tag}/{i}".encode(), digest_size=8).digest(), "big")
        return CacheEngineKey("kvfs-test-model", 1, 0, h, DTYPE)

    def chunk(self, tag, i, tokens=CHUNK):
        """A MemoryObj of ``tokens`` tokens from the backend's allocator, filled with pattern()."""
        shape = torch.Size([2, LAYERS, tokens, HEADS * HEAD])
        obj = self.backend.allocate([shape], [DTYPE], self.conn.meta_fmt)
        assert obj is not None, "LocalCPUBackend could not allocate"
        data = pattern(tag, i, obj.get_size())
        ctypes.memmove(obj.data_ptr, data, len(data))
        return obj

    @staticmethod
    def bytes_of(obj):
        return ctypes.string_at(obj.data_ptr, obj.get_size())

    def put_chunks(self, tag, indices, batched=True, tokens=CHUNK):
        objs = [self.chunk(tag, i, tokens) for i in indices]
        keys = [self.key(tag, i) for i in indices]
        if batched:
            self.run(self.conn.batched_put(keys, objs))
        else:
            for k, o in zip(keys, objs):
                self.run(self.conn.put(k, o))
        for o in objs:
            o.ref_count_down()
        return keys

    def missing(self, tag, indices):
        """Indices whose keys the connector does not see (exists_sync is LMCache's check)."""
        return [i for i in indices if not self.conn.exists_sync(self.key(tag, i))]

    def check_get(self, tag, indices, tokens=CHUNK):
        """batched_get of the keys; returns (mismatched, missing) index lists."""
        got = self.run(self.conn.batched_get([self.key(tag, i) for i in indices]))
        bad, miss = [], []
        for i, obj in zip(indices, got):
            if obj is None:
                miss.append(i)
                continue
            want = pattern(tag, i, tokens * TOKEN_BYTES)
            if self.bytes_of(obj) != want:
                bad.append(i)
            obj.ref_count_down()
        return bad, miss

    def close(self):
        self.run(self.conn.close())


# ----- child roles --------------------------------------------------------------------------


def role_produce(tag, count, segment_bytes, save_chunk_meta, hold=True, loop=False, batch=8):
    """Puts ``count`` chunks (then keeps putting new ones forever when ``loop``), checking each."""
    d = LMCacheDriver(segment_bytes=segment_bytes, save_chunk_meta=save_chunk_meta)
    emit("setup", hostname=d.conn.store.get_hostname())
    failed = []
    for start in range(0, count, batch):
        idx = list(range(start, min(count, start + batch)))
        d.put_chunks(tag, idx, batched=True)
        failed += d.missing(tag, idx)
    emit("stored", count=count, failed=failed)
    n = count
    while loop:  # a producer that is killed mid-put
        idx = list(range(n, n + batch))
        d.put_chunks(tag, idx, batched=True)
        n += batch
        emit("progress", stored=n)
    if hold:
        wait_for_quit()
    d.close()
    emit("closed")


ROLES = {"produce": role_produce}


# ----- tests ----------------------------------------------------------------------------------

if __name__ != "__main__":

    @pytest.fixture(params=[True, False], ids=["save_chunk_meta", "zero_copy"])
    def driver(request, cluster):
        d = LMCacheDriver(segment_bytes=0, save_chunk_meta=request.param)
        yield d
        d.close()

    def test_put_exists_get_byte_for_byte(driver, tag):
        """put and batched_put, exists / exists_sync / batched_async_contains, batched_get."""
        single = driver.put_chunks(tag, range(0, 4), batched=False)
        batched = driver.put_chunks(tag, range(4, 12), batched=True)
        assert driver.missing(tag, range(12)) == []
        assert driver.run(driver.conn.exists(single[0]))
        # Prefix hit count stops at the first absent key.
        probe = batched[:3] + [driver.key(tag, 999)] + single
        assert driver.run(driver.conn.batched_async_contains("lookup-1", probe)) == 3
        bad, miss = driver.check_get(tag, list(range(12)))
        assert (bad, miss) == ([], [])
        # A key nobody stored comes back as None, next to hits.
        got = driver.run(driver.conn.batched_get([driver.key(tag, 0), driver.key(tag, 998)]))
        assert got[0] is not None and got[1] is None
        got[0].ref_count_down()

    def test_partial_chunk(driver, tag):
        """A last chunk shorter than chunk_size comes back with its own length."""
        driver.put_chunks(tag, [0], tokens=5)
        driver.put_chunks(tag, [1], tokens=CHUNK)
        got = driver.run(driver.conn.batched_get([driver.key(tag, 0), driver.key(tag, 1)]))
        assert got[0] is not None and got[1] is not None
        assert got[0].get_size() == 5 * TOKEN_BYTES
        assert driver.bytes_of(got[0]) == pattern(tag, 0, 5 * TOKEN_BYTES)
        assert driver.bytes_of(got[1]) == pattern(tag, 1, CHUNK * TOKEN_BYTES)
        for o in got:
            o.ref_count_down()

    def test_first_writer_wins(driver, tag):
        """Two producers computing the same chunk: the stored bytes stay the first ones."""
        driver.put_chunks(tag, [0])
        other = driver.chunk(tag + "-other", 0)
        driver.run(driver.conn.put(driver.key(tag, 0), other))
        other.ref_count_down()
        assert driver.check_get(tag, [0]) == ([], [])

    def test_remove_then_close(cluster, tag):
        """Removal through the connector's store handle, then LMCache's close()."""
        d = LMCacheDriver(segment_bytes=0, save_chunk_meta=False)
        keys = d.put_chunks(tag, range(3))
        assert d.missing(tag, range(3)) == []
        time.sleep(LEASE_TTL_S + 0.2)  # exists_sync took read leases
        for k in keys:
            assert d.conn.store.remove(k.to_string()) == 0
        assert d.missing(tag, range(3)) == [0, 1, 2]
        assert d.check_get(tag, [0]) == ([], [0])
        store = d.conn.store
        d.close()  # unregister_buffer + store.close()
        assert d.conn.registered_buffer_ptr is None
        assert store.health_check() == 1

    @pytest.mark.parametrize("save_chunk_meta", [True, False], ids=["save_chunk_meta", "zero_copy"])
    def test_cross_process_embedded_segment(cluster, tag, save_chunk_meta):
        """A producer process with an embedded 32 MiB segment; this process reads its chunks."""
        p = Child(SCRIPT, "produce", tag=tag, count=24, segment_bytes=32 * MIB,
                  save_chunk_meta=save_chunk_meta)
        try:
            stored = p.wait_event("stored")
            assert stored["failed"] == []
            reader = LMCacheDriver(segment_bytes=0, save_chunk_meta=save_chunk_meta)
            try:
                assert reader.missing(tag, range(24)) == []
                assert reader.check_get(tag, list(range(24))) == ([], [])
            finally:
                reader.close()
        finally:
            p.finish()

    def test_sigkill_producer_then_new_producer(cluster, tag):
        """A producer killed mid-put (embedded segment, no close); the next producer's puts must
        all succeed at once and read back; chunks of the dead one read back right or not at all."""
        dead = Child(SCRIPT, "produce", tag=tag + "-dead", count=16, segment_bytes=32 * MIB,
                     save_chunk_meta=False, loop=True, hold=False)
        try:
            dead.wait_event("stored")
            dead.wait_event("progress")
        finally:
            dead.sigkill()
        nxt = Child(SCRIPT, "produce", tag=tag + "-next", count=32, segment_bytes=32 * MIB,
                    save_chunk_meta=False)
        try:
            stored = nxt.wait_event("stored")
            assert stored["failed"] == [], f"puts of the next producer failed: {stored}"
            reader = LMCacheDriver(segment_bytes=0, save_chunk_meta=False)
            try:
                assert reader.check_get(tag + "-next", list(range(32))) == ([], [])
                bad, _ = reader.check_get(tag + "-dead", list(range(16)))
                assert bad == [], "a dead producer's chunk read back with wrong bytes"
            finally:
                reader.close()
        finally:
            nxt.finish()


if __name__ == "__main__":
    child_main(ROLES)
