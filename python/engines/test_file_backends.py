"""The engines' own FILE backends, unchanged, on a plain directory and under a kvfs mount.

Three classes that keep KV cache as files in a directory an operator names:

* SGLang 0.5.23's HiCache ``HiCacheFile`` (``sglang.srt.mem_cache.hicache_storage``, what
  ``--hicache-storage-backend file`` builds), made by SGLang's own
  ``StorageBackendFactory.create_backend("file", storage_config, None)`` with
  ``extra_config={"file_storage_path": DIR, ...}``; pages are CPU tensors, passed as SGLang's
  generic (non zero-copy) page path passes them: ``set`` / ``batch_set`` / ``exists`` /
  ``batch_exists`` / ``get`` / ``batch_get`` / ``clear``, plus its metadata cache and LRU cap.
  A page is written to ``.<uuid>.tmp`` and ``os.replace``d onto ``<key>_<model>_<tp>_<tp_size>.bin``.
* LMCache 0.5.6's ``FSConnector`` (``lmcache.v1.storage_backend.connector.fs_connector``, what
  ``remote_url: fs://host:port/DIR`` selects), made by LMCache's ``CreateConnector`` over a
  real ``LocalCPUBackend`` (its allocator), so it comes wrapped in the
  ``InstrumentedRemoteConnector`` the ``RemoteBackend`` holds. ``put`` writes ``<key>.tmp``
  (28-byte chunk header + KV) and ``aiofiles.os.replace``s it onto ``<key>.data``.
* LMCache 0.5.6's ``LocalDiskBackend`` (``config.local_disk = DIR``), made with the arguments
  ``CreateStorageBackends`` gives it, over a ``LocalCPUBackend``, its writes running on the
  backend's own worker pool on an event loop in a thread (as the storage manager runs it).
  ``write_file`` is ``open(path, "wb")``; reads are ``open(path, "rb").readinto``.

Each test runs twice: on a plain temporary directory and on a directory under a kvfs mount
(``kvfs_mounts`` in conftest.py: ``kvfs up --mount`` plus a ``kvfs mount`` of the same cluster).
The two-mount tests give instance A the directory under mount 1 and instance B the same
directory under mount 2 (on a plain directory both get the one directory). Nothing of the
engines is patched: the point is that their classes run as they are. The engines swallow
most write errors (HiCacheFile logs and returns False; LocalDiskBackend drops the worker's
exception), so the assertion messages carry what the engines logged, or, for a write that
never completed, what the class's own ``write_file`` raises when called again.
"""

import asyncio
import ctypes
import hashlib
import logging
import os
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from _common import pattern  # noqa: E402

import pytest  # noqa: E402

pytest.importorskip("sglang.srt.mem_cache.hicache_storage")
pytest.importorskip("lmcache.v1.storage_backend.local_disk_backend")
pytest.importorskip("aiofiles")  # FSConnector's I/O (an LMCache extra in scripts/test-engines)

import torch  # noqa: E402
from lmcache.utils import CacheEngineKey, start_loop_in_thread_with_exceptions  # noqa: E402
from lmcache.v1.config import LMCacheEngineConfig  # noqa: E402
from lmcache.v1.memory_management import MemoryFormat  # noqa: E402
from lmcache.v1.metadata import LMCacheMetadata  # noqa: E402
from lmcache.v1.pin_monitor import PinMonitor  # noqa: E402
from lmcache.v1.storage_backend.connector import CreateConnector  # noqa: E402
from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend  # noqa: E402
from lmcache.v1.storage_backend.local_disk_backend import LocalDiskBackend  # noqa: E402
from sglang.srt.mem_cache.hicache_storage import HiCacheFile, HiCacheStorageConfig  # noqa: E402
from sglang.srt.mem_cache.storage import StorageBackendFactory  # noqa: E402

PAGE_BYTES = 16 << 10  # one HiCache page: 16 KiB of bf16
CHUNK = 16  # LMCache tokens per chunk
LAYERS, HEADS, HEAD = 2, 4, 32
DTYPE = torch.bfloat16
CHUNK_SHAPE = torch.Size([2, LAYERS, CHUNK, HEADS * HEAD])  # KV_2LTD
CHUNK_BYTES = 2 * LAYERS * CHUNK * HEADS * HEAD * 2
MODEL = "kvfs/test-model"
WRITE_WAIT_S = 10.0  # LocalDiskBackend: how long its asynchronous writes may take


# ----- targets ----------------------------------------------------------------------------


@pytest.fixture(params=["plain_dir", "kvfs_mount"])
def dirs(request, tmp_path, tag):
    """(directory for instance A, directory for instance B): one plain directory twice, or the
    same directory under mount 1 and under mount 2 of one kvfs cluster."""
    if request.param == "plain_dir":
        d = str(tmp_path / "store")
        return d, d
    mounts = request.getfixturevalue("kvfs_mounts").mounts
    return os.path.join(mounts[0], tag), os.path.join(mounts[1], tag)


@pytest.fixture
def engine_log(caplog):
    """The engines' warnings and errors (their write failures are logged, not raised)."""
    caplog.set_level(logging.WARNING)
    for name in ("sglang", "lmcache"):
        # LMCache's loggers do not propagate; the handler goes on them directly.
        logging.getLogger(name).addHandler(caplog.handler)
    yield lambda: "\n".join(
        f"{r.name}: {r.getMessage()}" for r in caplog.records if r.levelno >= logging.WARNING
    ) or "(nothing logged)"
    for name in ("sglang", "lmcache"):
        logging.getLogger(name).removeHandler(caplog.handler)


@pytest.fixture(autouse=True)
def _no_hicache_dir_override(monkeypatch):
    # SGLang's environment variable beats extra_config["file_storage_path"].
    monkeypatch.delenv("SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR", raising=False)


# ----- SGLang HiCacheFile -----------------------------------------------------------------


def hicache(path, **extra):
    """HiCacheFile as SGLang's cache controller creates it for ``--hicache-storage-backend file``."""
    config = HiCacheStorageConfig(
        tp_rank=0,
        tp_size=1,
        pp_rank=0,
        pp_size=1,
        attn_cp_rank=0,
        attn_cp_size=1,
        is_mla_model=False,
        enable_storage_metrics=False,
        is_page_first_layout=True,
        model_name=MODEL,
        extra_config={"file_storage_path": path, **extra},
    )
    store = StorageBackendFactory.create_backend("file", config, None)
    assert isinstance(store, HiCacheFile)
    return store


def page(tag, i):
    """Page ``i`` of a run: a bf16 CPU tensor of PAGE_BYTES pattern() bytes."""
    return torch.frombuffer(bytearray(pattern(tag, i, PAGE_BYTES)), dtype=torch.uint8).view(DTYPE)


def page_keys(tag, indices):
    return [f"{tag}-page{i}" for i in indices]


def tensor_bytes(t):
    return t.contiguous().view(torch.uint8).numpy().tobytes()


def hicache_bad_pages(store, tag, indices):
    """batch_get of the pages into fresh buffers: indices missing or with other bytes."""
    outs = [torch.zeros(PAGE_BYTES // 2, dtype=DTYPE) for _ in indices]
    got = store.batch_get(page_keys(tag, indices), outs)
    return [i for i, g, o in zip(indices, got, outs)
            if g is None or tensor_bytes(o) != pattern(tag, i, PAGE_BYTES)]


def bin_files(path):
    return sorted(n for n in os.listdir(path) if n.endswith(".bin"))


def test_hicache_file_set_exists_get(dirs, tag, engine_log):
    """set, batch_set, exists, batch_exists (prefix count), get and batch_get byte for byte,
    a miss, and a second set of a stored key (SGLang skips it: first writer wins)."""
    store = hicache(dirs[0])
    assert store.set(page_keys(tag, [0])[0], page(tag, 0)) is True, engine_log()
    assert store.batch_set(page_keys(tag, range(1, 8)), [page(tag, i) for i in range(1, 8)]) is True, \
        engine_log()
    assert store.exists(page_keys(tag, [0])[0])
    assert store.batch_exists(page_keys(tag, range(8))) == 8
    assert store.batch_exists(page_keys(tag, [0, 1, 2, 99, 3])) == 3
    out = torch.zeros(PAGE_BYTES // 2, dtype=DTYPE)
    assert store.get(page_keys(tag, [5])[0], out) is out
    assert tensor_bytes(out) == pattern(tag, 5, PAGE_BYTES)
    assert hicache_bad_pages(store, tag, list(range(8))) == []
    assert store.get(f"{tag}-never-stored", torch.zeros(PAGE_BYTES // 2, dtype=DTYPE)) is None
    assert store.set(page_keys(tag, [3])[0], page(tag + "-other", 3)) is True, engine_log()
    assert hicache_bad_pages(store, tag, [3]) == []
    assert len(bin_files(dirs[0])) == 8


def test_hicache_file_restart_rescans(dirs, tag, engine_log):
    """A new HiCacheFile on the same directory (metadata cache and LRU cap on) seeds its
    metadata cache and its evictor's byte count from the files, and reads them byte for byte."""
    extra = {"enable_metadata_cache": True, "metadata_ttl": -1, "max_size": "64M"}
    first = hicache(dirs[0], **extra)
    assert first.batch_set(page_keys(tag, range(6)), [page(tag, i) for i in range(6)]) is True, \
        engine_log()
    assert hicache_bad_pages(first, tag, list(range(6))) == []
    again = hicache(dirs[0], **extra)
    suffixed = [again._get_suffixed_key(k) for k in page_keys(tag, range(6))]
    assert [k for k in suffixed if not again.metadata_cache.contains(k)] == []
    assert again._evictor._total_bytes == 6 * PAGE_BYTES
    assert again.batch_exists(page_keys(tag, range(7))) == 6
    assert hicache_bad_pages(again, tag, list(range(6))) == []


def test_hicache_file_clear(dirs, tag, engine_log):
    """clear() after the pages were read removes every file; nothing exists afterwards, for
    this instance and for a new one; a page stored again reads back."""
    store = hicache(dirs[0])
    assert store.batch_set(page_keys(tag, range(4)), [page(tag, i) for i in range(4)]) is True, \
        engine_log()
    assert hicache_bad_pages(store, tag, list(range(4))) == []
    assert store.clear() is True, engine_log()
    assert os.listdir(dirs[0]) == []
    assert store.batch_exists(page_keys(tag, range(4))) == 0
    assert hicache(dirs[0]).batch_exists(page_keys(tag, range(4))) == 0
    assert store.set(page_keys(tag, [0])[0], page(tag, 0)) is True, engine_log()
    assert hicache_bad_pages(store, tag, [0]) == []


def test_hicache_file_lru_eviction(dirs, tag, engine_log):
    """A 4-page cap (``max_size``): storing 8 pages one by one unlinks the oldest files; every
    set succeeds, the directory stays under the cap, the newest page reads back."""
    store = hicache(dirs[0], max_size=str(4 * PAGE_BYTES))
    for i in range(8):
        assert store.set(page_keys(tag, [i])[0], page(tag, i)) is True, f"page {i}:\n{engine_log()}"
        if i < 7:
            assert hicache_bad_pages(store, tag, [i]) == []  # a read between writes
    files = bin_files(dirs[0])
    assert sum(os.path.getsize(os.path.join(dirs[0], n)) for n in files) <= 4 * PAGE_BYTES, \
        f"{files}\n{engine_log()}"
    assert not store.exists(page_keys(tag, [0])[0]), engine_log()
    assert hicache_bad_pages(store, tag, [7]) == []


def test_two_mounts_hicache_file(dirs, tag, engine_log):
    """Instance A stores through mount 1; instance B, on the same directory through mount 2,
    finds the pages (batch_exists) and loads them byte for byte."""
    a = hicache(dirs[0])
    assert a.batch_set(page_keys(tag, range(6)), [page(tag, i) for i in range(6)]) is True, \
        engine_log()
    b = hicache(dirs[1])
    assert b.batch_exists(page_keys(tag, range(7))) == 6
    assert hicache_bad_pages(b, tag, list(range(6))) == []


# ----- LMCache: shared pieces ---------------------------------------------------------------


class LMCacheProcess:
    """What an LMCache engine process holds for its storage backends: the config, a
    LocalCPUBackend (the allocator) and the storage manager's event loop, run in a thread."""

    def __init__(self, local_disk=None, remote_url=None):
        self.config = LMCacheEngineConfig.from_defaults(
            chunk_size=CHUNK,
            local_cpu=True,
            max_local_cpu_size=0.05,
            local_disk=local_disk,
            max_local_disk_size=0.05 if local_disk else 0.0,
            remote_url=remote_url,
            lmcache_instance_id=f"kvfs-file-backends-{os.getpid()}",
        )
        self.metadata = LMCacheMetadata(
            model_name=MODEL,
            world_size=1,
            local_world_size=1,
            worker_id=0,
            local_worker_id=0,
            kv_dtype=DTYPE,
            kv_shape=(LAYERS, 2, CHUNK, HEADS, HEAD),
            chunk_size=CHUNK,
        )
        # LMCacheEngine's start-up makes this singleton; MemoryObj.pin() needs it.
        PinMonitor.GetOrCreate(self.config, self.metadata)
        self.cpu = LocalCPUBackend(self.config, self.metadata)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(
            target=start_loop_in_thread_with_exceptions, args=(self.loop,), daemon=True
        )
        self.thread.start()

    def run(self, coro, timeout=30):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def chunk(self, tag, i):
        """A MemoryObj from the LocalCPUBackend, filled with pattern() bytes."""
        obj = self.cpu.allocate([CHUNK_SHAPE], [DTYPE], MemoryFormat.KV_2LTD)
        assert obj is not None, "LocalCPUBackend could not allocate"
        ctypes.memmove(obj.data_ptr, pattern(tag, i, CHUNK_BYTES), CHUNK_BYTES)
        return obj

    def close(self):
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)
        self.cpu.close()


def lm_key(tag, i):
    h = int.from_bytes(hashlib.blake2b(f"{tag}/{i}".encode(), digest_size=8).digest(), "big")
    return CacheEngineKey(MODEL, 1, 0, h, DTYPE)


def obj_bytes(obj):
    return ctypes.string_at(obj.data_ptr, obj.get_size())


def bad_chunks(tag, indices, objs):
    """Indices whose MemoryObj is missing or holds other bytes; releases the objects."""
    bad = []
    for i, obj in zip(indices, objs):
        if obj is None or obj_bytes(obj) != pattern(tag, i, CHUNK_BYTES):
            bad.append(i)
        if obj is not None:
            obj.ref_count_down()
    return bad


# ----- LMCache FSConnector ------------------------------------------------------------------


class FsBackend:
    """One engine process's ``fs://`` remote storage: FSConnector from CreateConnector."""

    def __init__(self, path):
        self.proc = LMCacheProcess(remote_url=f"fs://localhost:0{path}")
        self.conn = CreateConnector(
            self.proc.config.remote_url, self.proc.loop, self.proc.cpu, self.proc.config,
            self.proc.metadata,
        )
        assert type(self.conn.getWrappedConnector()).__name__ == "FSConnector"
        assert [str(p) for p in self.conn.getWrappedConnector().base_paths] == [path]

    def put(self, tag, indices):
        """One put per key, all in flight at once: what RemoteBackend.batched_submit_put_task
        does for a connector without batched_put (the instrumented put releases each object).
        Raises the first put's error."""
        futures = [
            asyncio.run_coroutine_threadsafe(
                self.conn.put(lm_key(tag, i), self.proc.chunk(tag, i)), self.proc.loop
            )
            for i in indices
        ]
        for f in futures:
            f.result(30)

    def names(self):
        """list(): the stems of the .data files."""
        return sorted(self.proc.run(self.conn.list()))

    @staticmethod
    def names_of(tag, indices):
        # FSConnector's file name: the key string with "/" spelled "-SEP-".
        return sorted(lm_key(tag, i).to_string().replace("/", "-SEP-") for i in indices)

    def bad(self, tag, indices):
        """batched_get_non_blocking of the keys: indices missing or with other bytes."""
        got = self.proc.run(self.conn.batched_get_non_blocking("lookup", [lm_key(tag, i) for i in indices]))
        return bad_chunks(tag, indices, got + [None] * (len(indices) - len(got)))

    def missing(self, tag, indices):
        return [i for i in indices if not self.conn.exists_sync(lm_key(tag, i))]

    def close(self):
        if self.proc.thread.is_alive():
            self.proc.run(self.conn.close())
            self.proc.close()


@pytest.fixture
def fs_backends():
    made = []

    def make(path):
        made.append(FsBackend(path))
        return made[-1]

    yield make
    for b in made:
        b.close()


def test_fs_connector_put_exists_get(dirs, tag, fs_backends):
    """put, a batch of puts, exists / exists_sync / batched_async_contains, get and
    batched_get_non_blocking byte for byte, list, a miss, and the same chunk put again."""
    fs = fs_backends(dirs[0])
    assert fs.conn.support_batched_put() is False
    fs.put(tag, [0])
    fs.put(tag, range(1, 8))
    assert fs.missing(tag, range(8)) == []
    assert fs.proc.run(fs.conn.exists(lm_key(tag, 0)))
    probe = [lm_key(tag, i) for i in (0, 1, 2)] + [lm_key(tag, 99), lm_key(tag, 3)]
    assert fs.proc.run(fs.conn.batched_async_contains("lookup-1", probe)) == 3
    assert bad_chunks(tag, [4], [fs.proc.run(fs.conn.get(lm_key(tag, 4)))]) == []
    assert fs.bad(tag, list(range(8))) == []
    assert fs.proc.run(fs.conn.get(lm_key(tag, 99))) is None
    names = fs.names()
    assert names == fs.names_of(tag, range(8))
    fs.put(tag, [2])  # a second engine computed the same chunk
    assert fs.bad(tag, [2]) == []
    assert sorted(os.listdir(dirs[0])) == sorted(n + ".data" for n in names)


def test_fs_connector_restart(dirs, tag, fs_backends):
    """A new FSConnector on the same directory lists, finds and loads what the first stored."""
    first = fs_backends(dirs[0])
    first.put(tag, range(4))
    assert first.bad(tag, list(range(4))) == []
    again = fs_backends(dirs[0])
    assert again.names() == again.names_of(tag, range(4))
    assert again.missing(tag, range(4)) == []
    assert again.bad(tag, list(range(4))) == []


def test_fs_connector_remove(dirs, tag, fs_backends):
    """remove_sync of chunks just read: True, then gone (exists_sync, get, list); a second
    remove_sync is False."""
    fs = fs_backends(dirs[0])
    fs.put(tag, range(4))
    assert fs.bad(tag, list(range(4))) == []
    failed = [i for i in range(4) if not fs.conn.remove_sync(lm_key(tag, i))]
    assert failed == [], "remove_sync failed (LMCache logs the errno: 'Failed to remove file')"
    assert fs.missing(tag, range(4)) == [0, 1, 2, 3]
    assert fs.proc.run(fs.conn.get(lm_key(tag, 0))) is None
    assert fs.names() == []
    assert fs.conn.remove_sync(lm_key(tag, 0)) is False


def test_two_mounts_fs_connector(dirs, tag, fs_backends):
    """FSConnector A puts through mount 1; B, on the same directory through mount 2, lists,
    finds and loads the chunks byte for byte."""
    a = fs_backends(dirs[0])
    a.put(tag, range(6))
    b = fs_backends(dirs[1])
    assert b.names() == b.names_of(tag, range(6))
    assert b.missing(tag, range(6)) == []
    assert b.proc.run(b.conn.batched_async_contains("lookup-b", [lm_key(tag, i) for i in range(7)])) == 6
    assert b.bad(tag, list(range(6))) == []


# ----- LMCache LocalDiskBackend -------------------------------------------------------------


class DiskBackend:
    """One engine process's local disk tier: LocalDiskBackend on ``config.local_disk``."""

    def __init__(self, path):
        self.path = path
        self.proc = LMCacheProcess(local_disk=path)
        self.disk = LocalDiskBackend(self.proc.config, self.proc.loop, self.proc.cpu, "cpu", None,
                                     self.proc.metadata)
        assert self.disk.path == path
        self.written = set()
        self.cond = threading.Condition()

    def _done(self, key):
        with self.cond:
            self.written.add(key)
            self.cond.notify_all()

    def put(self, tag, indices, batched=True):
        """submit_put_task / batched_submit_put_task, then waits for every write to land (the
        completion callback LMCache calls after the file is written and indexed)."""
        objs = [self.proc.chunk(tag, i) for i in indices]
        keys = [lm_key(tag, i) for i in indices]
        if batched:
            self.disk.batched_submit_put_task(keys, objs, on_complete_callback=self._done)
        else:
            for k, o in zip(keys, objs):
                self.disk.submit_put_task(k, o, on_complete_callback=self._done)
        deadline = time.monotonic() + WRITE_WAIT_S
        with self.cond:
            while not set(keys) <= self.written and time.monotonic() < deadline:
                self.cond.wait(0.1)
            pending = [i for i, k in zip(indices, keys) if k not in self.written]
        try:
            assert pending == [], self._diagnose(tag, pending, objs[indices.index(pending[0])]
                                                 if pending else None)
        finally:
            for o in objs:
                o.ref_count_down()

    def _diagnose(self, tag, pending, obj):
        """LocalDiskBackend drops the exception of a failed write (the worker's future is never
        awaited); the message names what the class's own write_file raises for one of them."""
        path = self.disk._key_to_path(lm_key(tag, pending[0]))
        try:
            self.disk.write_file(obj.byte_array, path + ".diagnose")
            again = "write_file of a new path succeeds"
        except OSError as e:
            again = f"write_file of a new path raises {e!r}"
        try:
            self.disk.write_file(obj.byte_array, path)
            why = "write_file of the same path now succeeds"
        except OSError as e:
            why = f"write_file(buffer, {path!r}) raises {e!r}"
        return (f"writes of chunks {pending} never completed in {WRITE_WAIT_S} s (still in "
                f"flight: {[i for i in pending if self.disk.exists_in_put_tasks(lm_key(tag, i))]});"
                f" {why}; {again}")

    def missing(self, tag, indices):
        return [i for i in indices if not self.disk.contains(lm_key(tag, i))]

    def bad(self, tag, indices):
        """batched_get_blocking of the keys: indices missing or with other bytes."""
        return bad_chunks(tag, indices, self.disk.batched_get_blocking([lm_key(tag, i) for i in indices]))

    def files(self):
        return sorted(n for n in os.listdir(self.path) if n.endswith(".pt"))

    def close(self):
        if self.proc.thread.is_alive():
            self.disk.close()
            self.proc.close()


@pytest.fixture
def disk_backends():
    made = []

    def make(path):
        made.append(DiskBackend(path))
        return made[-1]

    yield make
    for b in made:
        b.close()


def test_local_disk_put_contains_get(dirs, tag, disk_backends):
    """submit_put_task and batched_submit_put_task, contains / batched_async_contains, and
    get_blocking, batched_get_blocking and batched_get_non_blocking byte for byte."""
    d = disk_backends(dirs[0])
    d.put(tag, [0], batched=False)
    d.put(tag, list(range(1, 8)))
    assert d.missing(tag, range(8)) == []
    probe = [lm_key(tag, i) for i in (0, 1, 2)] + [lm_key(tag, 99), lm_key(tag, 3)]
    assert d.proc.run(d.disk.batched_async_contains("lookup-1", probe)) == 3
    assert bad_chunks(tag, [5], [d.disk.get_blocking(lm_key(tag, 5))]) == []
    assert d.bad(tag, list(range(8))) == []
    got = d.proc.run(d.disk.batched_get_non_blocking("lookup-2", [lm_key(tag, i) for i in range(4)]))
    for o in got:
        o.unpin()  # the prefetch pins what it loads; the retrieve that consumes it unpins
    assert bad_chunks(tag, list(range(4)), got) == []
    assert d.disk.get_blocking(lm_key(tag, 99)) is None
    assert len(d.files()) == 8


def test_local_disk_restart(dirs, tag, disk_backends):
    """A new LocalDiskBackend on the same directory: LMCache 0.5.6 keeps the disk index in
    memory only (no rescan), so it finds nothing while the files stay; the engine then stores
    the recomputed chunks again, over the existing files, and they load byte for byte."""
    first = disk_backends(dirs[0])
    first.put(tag, list(range(4)))
    assert first.bad(tag, list(range(4))) == []
    first.close()  # the engine process ends
    again = disk_backends(dirs[0])
    assert again.missing(tag, range(4)) == [0, 1, 2, 3]
    assert len(again.files()) == 4
    again.put(tag, list(range(4)))
    assert again.missing(tag, range(4)) == []
    assert again.bad(tag, list(range(4))) == []


def test_local_disk_remove(dirs, tag, disk_backends):
    """remove() of chunks just read: True, the file unlinked, contains False; a second
    remove() is False."""
    d = disk_backends(dirs[0])
    d.put(tag, list(range(4)))
    assert d.bad(tag, list(range(4))) == []
    for i in range(4):
        assert d.disk.remove(lm_key(tag, i)) is True
    assert d.files() == []
    assert d.missing(tag, range(4)) == [0, 1, 2, 3]
    assert d.disk.remove(lm_key(tag, 0)) is False


def test_two_mounts_local_disk(dirs, tag, disk_backends):
    """LocalDiskBackend A stores through mount 1. B, on the same directory through mount 2,
    has an empty index (LMCache's disk index is per process); told of A's chunks with
    insert_key (the call its own write path makes once a file is written), B loads them byte
    for byte from the files A wrote."""
    a = disk_backends(dirs[0])
    a.put(tag, list(range(6)))
    b = disk_backends(dirs[1])
    assert b.missing(tag, range(6)) == list(range(6))
    assert b.files() == a.files()
    for i in range(6):
        b.disk.insert_key(lm_key(tag, i), CHUNK_BYTES, CHUNK_SHAPE, DTYPE, MemoryFormat.KV_2LTD)
    assert b.bad(tag, list(range(6))) == []
