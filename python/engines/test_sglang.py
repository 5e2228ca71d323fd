"""SGLang 0.5.23's real HiCache ``MooncakeStore`` on kvfs.

The class is ``sglang.srt.mem_cache.storage.mooncake_store.mooncake_store.MooncakeStore`` (what
``--hicache-storage-backend mooncake`` builds), configured through ``extra_config`` as a server
passes it, with ``check_server`` on (it polls the master's ``/get_all_segments``) and the
host KV pool stand-in that SGLang's own ``test_mooncake_store.py`` ships
(``create_mock_host_kv_cache``, imported from the installed package). Nothing is patched.

Calls made: ``setup(...)`` positional with ``engine=None``, the warmup ``put``/``is_exist``/
``get``, ``register_buffer`` of the host pool, ``batch_is_exist``, ``batch_put_from`` (MHA: a K
and a V object per page), ``batch_put_from_multi_buffers`` (MLA with several buffers per page,
one object each), ``batch_get_into`` / ``batch_get_into_multi_buffers``, ``remove_all``.
"""

import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from _common import (  # noqa: E402
    LEASE_TTL_S,
    MIB,
    Child,
    child_main,
    emit,
    master_addr,
    metrics_port,
    pattern,
    wait_for_quit,
)

if __name__ != "__main__":
    import pytest

    pytest.importorskip("sglang.srt.mem_cache.storage.mooncake_store.mooncake_store")

import torch  # noqa: E402
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig  # noqa: E402
from sglang.srt.mem_cache.storage.mooncake_store.mooncake_store import MooncakeStore  # noqa: E402
from sglang.srt.mem_cache.storage.mooncake_store.test_mooncake_store import (  # noqa: E402
    create_mock_host_kv_cache,
)

SCRIPT = os.path.abspath(__file__)
PAGE_ELEMENTS = 1024  # float32 per entry: 4 KiB objects
BUFFER_ELEMENTS = 1 << 20  # 4 MiB host pool: 256 pages of 1 KV pair


class SGLangDriver:
    """One TP rank's HiCache L3 backend: MooncakeStore over a mock host KV pool."""

    def __init__(self, segment_bytes=0, is_mla=False, entries_per_page=None, tp_rank=0, tp_size=1):
        self.is_mla = is_mla
        self.entries = entries_per_page or (1 if is_mla else 2)
        extra = {
            "master_server_address": master_addr(),
            "master_metrics_port": metrics_port(),
            "check_server": True,
            "local_hostname": "127.0.0.1",
            "protocol": "tcp",
            "device_name": "",
            # SGLang divides it by tp_size * pp_size for each rank.
            "global_segment_size": segment_bytes * tp_size,
        }
        config = HiCacheStorageConfig(
            tp_rank=tp_rank,
            tp_size=tp_size,
            pp_rank=0,
            pp_size=1,
            attn_cp_rank=0,
            attn_cp_size=1,
            is_mla_model=is_mla,
            enable_storage_metrics=False,
            is_page_first_layout=True,
            model_name="kvfs/test-model",
            extra_config=extra,
        )
        self.store = MooncakeStore(config)
        self.host, self.buffer = create_mock_host_kv_cache(
            BUFFER_ELEMENTS, entries_per_page=self.entries, page_elements=PAGE_ELEMENTS
        )
        self.store.register_mem_pool_host(self.host)
        self.entry_bytes = PAGE_ELEMENTS * 4
        self.page_bytes = self.entries * self.entry_bytes
        self.bytes = self.buffer.view(torch.uint8)

    def fill(self, tag, pages, indices):
        for p, i in zip(pages, indices):
            data = torch.frombuffer(bytearray(pattern(tag, i, self.page_bytes)), dtype=torch.uint8)
            self.bytes[p * self.page_bytes:(p + 1) * self.page_bytes].copy_(data)

    def page(self, p):
        return self.bytes[p * self.page_bytes:(p + 1) * self.page_bytes].numpy().tobytes()

    def clear_pages(self, pages):
        for p in pages:
            self.bytes[p * self.page_bytes:(p + 1) * self.page_bytes].zero_()

    @staticmethod
    def keys(tag, indices):
        return [f"{tag}-page{i}" for i in indices]

    def set_pages(self, tag, indices, pages):
        """batch_set_v1 of the pages' bytes under the keys of ``indices``: per-page bools."""
        self.fill(tag, pages, indices)
        return self.store.batch_set_v1(self.keys(tag, indices), torch.tensor(pages, dtype=torch.int64))

    def get_pages(self, tag, indices, pages):
        """batch_get_v1 into ``pages``: (per-page bools, indices whose bytes differ)."""
        self.clear_pages(pages)
        ok = self.store.batch_get_v1(self.keys(tag, indices), torch.tensor(pages, dtype=torch.int64))
        bad = [i for i, p, good in zip(indices, pages, ok)
               if good and self.page(p) != pattern(tag, i, self.page_bytes)]
        return ok, bad


# ----- child roles --------------------------------------------------------------------------


def role_produce(tag, count, segment_bytes, is_mla=False, hold=True, loop=False, batch=8):
    d = SGLangDriver(segment_bytes=segment_bytes, is_mla=is_mla)
    emit("setup", hostname=d.store.store.get_hostname())
    failed = []
    for start in range(0, count, batch):
        idx = list(range(start, min(count, start + batch)))
        ok = d.set_pages(tag, idx, [i % 64 for i in idx])
        failed += [i for i, good in zip(idx, ok) if not good]
    emit("stored", count=count, failed=failed)
    n = count
    while loop:
        idx = list(range(n, n + batch))
        d.set_pages(tag, idx, [i % 64 for i in idx])
        n += batch
        emit("progress", stored=n)
    if hold:
        wait_for_quit()
    d.store.close()
    d.store.store.close()
    emit("closed")


ROLES = {"produce": role_produce}


# ----- tests ----------------------------------------------------------------------------------

if __name__ != "__main__":

    @pytest.fixture(params=[(False, None), (True, None), (True, 3)], ids=["mha", "mla", "mla_3buf"])
    def driver(request, cluster):
        is_mla, entries = request.param
        d = SGLangDriver(segment_bytes=0, is_mla=is_mla, entries_per_page=entries)
        yield d
        d.store.store.close()

    def test_batch_set_exists_get_byte_for_byte(driver, tag):
        """batch_set_v1 / batch_exists / batch_get_v1 (MHA: K and V per page; MLA with 3
        buffers per page goes through the multi-buffer calls)."""
        n = 13
        assert all(driver.set_pages(tag, list(range(n)), list(range(n))))
        assert driver.store.batch_exists(driver.keys(tag, range(n))) == n
        ok, bad = driver.get_pages(tag, list(range(n)), list(range(64, 64 + n)))
        assert all(ok) and bad == []
        # Writing the same pages again skips them (batch_is_exist first) and still succeeds.
        assert all(driver.set_pages(tag, list(range(n)), list(range(n))))

    def test_partial_prefix(driver, tag):
        """Pages 0-4 and 6-7 stored, 5 missing: exists counts the prefix; get fails page 5 only."""
        stored = [0, 1, 2, 3, 4, 6, 7]
        assert all(driver.set_pages(tag, stored, stored))
        assert driver.store.batch_exists(driver.keys(tag, range(8))) == 5
        ok, bad = driver.get_pages(tag, list(range(8)), list(range(100, 108)))
        assert ok == [True] * 5 + [False] + [True] * 2
        assert bad == []

    def test_single_set_exists_get(cluster, tag):
        """set / exists / get with target locations, as SGLang's own test does; and batch_set /
        batch_get (the v0 API)."""
        d = SGLangDriver(segment_bytes=0)
        try:
            size = d.entry_bytes
            src = d.buffer[:PAGE_ELEMENTS]
            src.view(torch.uint8).copy_(torch.frombuffer(bytearray(pattern(tag, 0, size)), dtype=torch.uint8))
            dst = d.buffer[PAGE_ELEMENTS:2 * PAGE_ELEMENTS]
            key = f"{tag}-single"
            assert d.store.set(key, target_location=src.data_ptr(), target_sizes=size) is True
            assert d.store.exists(key)
            assert d.store.get(key, target_location=dst.data_ptr(), target_sizes=size) is True
            assert dst.view(torch.uint8).numpy().tobytes() == pattern(tag, 0, size)
            keys = [f"{tag}-v0-{i}" for i in range(4)]
            locs = [d.buffer[i * PAGE_ELEMENTS:].data_ptr() for i in range(4)]
            outs = [d.buffer[(8 + i) * PAGE_ELEMENTS:].data_ptr() for i in range(4)]
            assert d.store.batch_set(keys, target_locations=locs, target_sizes=[size] * 4) is True
            assert d.store.batch_get(keys, target_locations=outs, target_sizes=[size] * 4) == 2
            raw = d.buffer.view(torch.uint8).numpy()
            n = 4 * size
            assert raw[8 * size:8 * size + n].tobytes() == raw[:n].tobytes()
        finally:
            d.store.store.close()

    def test_clear_then_close(cluster, tag):
        """SGLang's clear() (remove_all without force, after the read leases) and close()."""
        d = SGLangDriver(segment_bytes=0)
        assert all(d.set_pages(tag, [0, 1, 2], [0, 1, 2]))
        assert d.store.batch_exists(d.keys(tag, range(3))) == 3
        time.sleep(LEASE_TTL_S + 0.2)
        d.store.clear()
        assert d.store.batch_exists(d.keys(tag, range(3))) == 0
        d.store.close()
        raw = d.store.store
        assert raw.close() == 0
        assert raw.health_check() == 1

    @pytest.mark.parametrize("is_mla", [False, True], ids=["mha", "mla"])
    def test_cross_process_embedded_segment(cluster, tag, is_mla):
        """A TP rank with an embedded 32 MiB segment stores pages; this process reads them."""
        p = Child(SCRIPT, "produce", tag=tag, count=24, segment_bytes=32 * MIB, is_mla=is_mla)
        try:
            assert p.wait_event("stored")["failed"] == []
            reader = SGLangDriver(segment_bytes=0, is_mla=is_mla)
            try:
                assert reader.store.batch_exists(reader.keys(tag, range(24))) == 24
                ok, bad = reader.get_pages(tag, list(range(24)), list(range(100, 124)))
                assert all(ok) and bad == []
            finally:
                reader.store.store.close()
        finally:
            p.finish()

    def test_sigkill_producer_then_new_producer(cluster, tag):
        """A rank killed mid-put (embedded segment, no close); the next rank's puts must all
        succeed at once and read back; the dead rank's pages read back right or not at all."""
        dead = Child(SCRIPT, "produce", tag=tag + "-dead", count=16, segment_bytes=32 * MIB,
                     loop=True, hold=False)
        try:
            dead.wait_event("stored")
            dead.wait_event("progress")
        finally:
            dead.sigkill()
        nxt = Child(SCRIPT, "produce", tag=tag + "-next", count=32, segment_bytes=32 * MIB)
        try:
            stored = nxt.wait_event("stored")
            assert stored["failed"] == [], f"puts of the next producer failed: {stored}"
            reader = SGLangDriver(segment_bytes=0)
            try:
                ok, bad = reader.get_pages(tag + "-next", list(range(32)), list(range(100, 132)))
                assert all(ok) and bad == []
                _, bad = reader.get_pages(tag + "-dead", list(range(16)), list(range(140, 156)))
                assert bad == [], "a dead producer's page read back with wrong bytes"
            finally:
                reader.store.store.close()
        finally:
            nxt.finish()


if __name__ == "__main__":
    child_main(ROLES)
