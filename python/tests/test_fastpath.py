"""``kvfs.fastpath`` against a real mount: a ``kvfs mount`` process on the session's cluster.

Objects put through the fast path are read back through it and through the FUSE file, byte for
byte; the errors a caller sees (errnos per item, OSError for single calls and for paths that are
not kvfs mounts, ValueError for bad ranges and oversized batches) are checked as they surface;
the GIL is shown to be released by a thread that makes progress only while the ioctl runs.
Skipped only where /dev/fuse is missing.
"""

import errno
import gc
import json
import os
import subprocess
import sys
import threading

import numpy as np
import pytest

from conftest import wait_until

if not os.path.exists("/dev/fuse"):
    pytest.skip("no /dev/fuse: the fast path needs a FUSE mount", allow_module_level=True)

import kvfs.fastpath as kfp  # noqa: E402


def pattern(n, seed):
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


@pytest.fixture(scope="module")
def mount(cluster, tmp_path_factory):
    """A ``kvfs mount`` process serving the cluster's pool; yields the mount point."""
    mnt = str(tmp_path_factory.mktemp("fastpath") / "mnt")
    log = open(os.path.join(cluster.tmp, "mount.log"), "wb")
    p = subprocess.Popen(
        [cluster.bin, "--master", cluster.master, "mount", mnt],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        wait_until(
            lambda: os.path.ismount(mnt) and os.path.exists(os.path.join(mnt, ".kvfs/control")),
            what="the mount",
        )
        yield mnt
    finally:
        p.terminate()
        try:
            p.wait(timeout=15)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
        if os.path.ismount(mnt):
            subprocess.run(["umount", "-l", mnt], check=False)


@pytest.fixture
def fp(mount):
    with kfp.open(mount) as f:
        yield f


def registered(mount):
    """The ids of this process's buffers the daemon holds (``/.kvfs/buffers.json``)."""
    with open(os.path.join(mount, ".kvfs/buffers.json")) as f:
        doc = json.load(f)
    return {b["id"] for b in doc["buffers"] if b["pid"] == os.getpid()}


def test_put_then_get_through_fastpath_and_fuse(fp, mount, key):
    sizes = [1, 4095, 4096, 65537, (1 << 20) + 3]
    buf = fp.alloc(8 << 20)
    a = buf.numpy()
    items, at = [], 0
    for i, n in enumerate(sizes):
        a[at : at + n] = pattern(n, i)
        items.append((f"{key}/obj{i}", at, n))
        at += n
    assert fp.put(buf, items) == [(0, n) for n in sizes]
    # Back into other offsets of the buffer, each with room to spare.
    gets, base = [], 4 << 20
    for i, n in enumerate(sizes):
        gets.append((f"{key}/obj{i}", base, n + 100))
        base += n + 100
    a[4 << 20 :] = 0
    assert fp.get(buf, gets) == [(0, n) for n in sizes]
    for i, ((_k, off, _cap), n) in enumerate(zip(gets, sizes)):
        assert np.array_equal(a[off : off + n], pattern(n, i)), f"object {i} through the fast path"
        with open(os.path.join(mount, key, f"obj{i}"), "rb") as f:
            assert f.read() == pattern(n, i).tobytes(), f"object {i} through FUSE"
    # Single-item calls.
    assert fp.get_one(buf, f"{key}/obj4", 0) == sizes[4]
    assert np.array_equal(a[: sizes[4]], pattern(sizes[4], 4))


def test_a_file_written_through_fuse_is_read_by_the_fastpath(fp, mount, key):
    data = pattern(300_001, 7)
    with open(os.path.join(mount, key), "wb") as f:
        f.write(data.tobytes())
    buf = fp.alloc(1 << 20)
    assert fp.get_one(buf, key, 4096, 400_000) == data.size
    assert np.array_equal(buf.numpy()[4096 : 4096 + data.size], data)


def test_first_writer_wins(fp, key):
    buf = fp.alloc(8192)
    a = buf.numpy()
    a[:4096], a[4096:] = 1, 2
    assert fp.put_one(buf, key, 0, 4096) == 4096
    assert fp.put(buf, [(key, 4096, 4096)]) == [(0, 4096)]  # exists: kept
    assert fp.get_one(buf, key, 4096, 4096) == 4096
    assert (a[4096:] == 1).all()


def test_missing_key_is_enoent(fp, key):
    buf = fp.alloc(4096)
    assert fp.get(buf, [(f"{key}/missing", 0, 4096)]) == [(-errno.ENOENT, 0)]
    with pytest.raises(FileNotFoundError) as e:
        fp.get_one(buf, f"{key}/missing")
    assert e.value.errno == errno.ENOENT and e.value.filename == f"{key}/missing"
    assert "no such object" in str(e.value)


def test_too_small_destination_is_eoverflow_with_the_size(fp, key):
    buf = fp.alloc(64 << 10)
    buf.numpy()[:] = 9
    assert fp.put_one(buf, key, 0, 50_000) == 50_000
    assert fp.get(buf, [(key, 0, 49_999), (key, 0, 0)]) == [(-errno.EOVERFLOW, 50_000)] * 2
    with pytest.raises(OSError) as e:
        fp.get_one(buf, key, 0, 1000)
    assert e.value.errno == errno.EOVERFLOW and e.value.size == 50_000
    assert "50000 bytes" in str(e.value) and "1000-byte" in str(e.value)
    # kvfs.fastpath.check raises the first failure of a batch, with the same fields.
    items = [(key, 0, 50_000), (key, 0, 10)]
    with pytest.raises(OSError) as e:
        kfp.check(fp.get(buf, items), items)
    assert e.value.errno == errno.EOVERFLOW and e.value.size == 50_000 and e.value.filename == key
    assert kfp.check(fp.get(buf, items[:1]), items[:1]) == [50_000]


def test_bad_ranges_and_oversized_batches_submit_nothing(fp, key):
    buf = fp.alloc(4096)
    for bad in [(0, 4097), (4096, 1), (-1, 10), (10, -1), (1 << 62, 1 << 62)]:
        with pytest.raises(ValueError, match="outside|negative"):
            fp.get(buf, [(key, *bad)])
    with pytest.raises(ValueError, match="outside"):
        fp.get_one(buf, key, 4000, 100)
    # A bad item fails the whole call before anything reaches the daemon.
    with pytest.raises(ValueError, match="item 1"):
        fp.put(buf, [(key, 0, 10), (key, 4090, 10)])
    assert fp.get(buf, [(key, 0, 4096)]) == [(-errno.ENOENT, 0)]
    limit = fp.info["batch_items_max"]
    with pytest.raises(ValueError, match=f"batch_items_max = {limit}"):
        fp.get(buf, [(key, 0, 1)] * (limit + 1))
    assert len(fp.get(buf, [(key, 0, 1)] * limit)) == limit
    with pytest.raises(TypeError):
        fp.get(buf, [(b"bytes-key", 0, 1)])
    with pytest.raises(TypeError):
        fp.get(buf, [(key, 0)])
    assert fp.get(buf, []) == []
    # Invalid items the daemon judges come back as statuses.
    assert fp.put(buf, [("", 0, 10), (key, 0, 0)]) == [(-errno.EINVAL, 0)] * 2
    too_long = "k" * (fp.info["key_bytes_max"] + 1)
    assert fp.get(buf, [(too_long, 0, 10)]) == [(-errno.ENAMETOOLONG, 0)]


def test_keys_past_the_key_area_run_as_several_submits(fp, key):
    buf = fp.alloc(64 << 10, key_area_bytes=fp.info["key_bytes_max"])
    a = buf.numpy()
    keys = [f"{key}/{i:02d}-" + "x" * 1500 for i in range(12)]  # 18 KB of keys, 4 KiB of area
    for i in range(len(keys)):
        a[i * 1000 : (i + 1) * 1000] = i
    assert fp.put(buf, [(k, i * 1000, 1000) for i, k in enumerate(keys)]) == [(0, 1000)] * 12
    a[:] = 255
    got = fp.get(buf, [(k, 32768 + i * 1000, 1000) for i, k in enumerate(keys)])
    assert got == [(0, 1000)] * 12
    for i in range(len(keys)):
        assert (a[32768 + i * 1000 : 32768 + (i + 1) * 1000] == i).all()


def test_numpy_views_are_writable_and_zero_copy(fp, key):
    buf = fp.alloc(1 << 20)
    assert len(buf) == buf.nbytes == 1 << 20 and buf.id > 0
    a, f32, mv = buf.numpy(), buf.numpy(np.float32), memoryview(buf)
    assert a.flags.writeable and not mv.readonly and f32.shape == (1 << 18,)
    f32[:1024] = np.arange(1024, dtype=np.float32)  # written through one view...
    assert mv[:4] == np.float32(0).tobytes() and a[4:8].tobytes() == np.float32(1).tobytes()
    assert fp.put_one(buf, key, 0, 4096) == 4096  # ...stored from the same memory
    a[:] = 0
    assert fp.get_one(buf, key, 8192, 4096) == 4096  # and read into views made before
    assert np.array_equal(f32[2048:3072], np.arange(1024, dtype=np.float32))
    # The data area is page aligned, after the head the library keeps.
    assert a.ctypes.data % 4096 == 0 and buf.head_bytes % 4096 == 0


def test_torch_views(fp, key):
    torch = pytest.importorskip("torch")
    buf = fp.alloc(1 << 20)
    t = buf.tensor()
    assert t.dtype == torch.uint8 and t.numel() == 1 << 20
    t[:4096] = 42
    assert buf.numpy()[100] == 42  # the same memory
    assert fp.put_one(buf, key, 0, 4096) == 4096
    h = buf.tensor(torch.float16)
    h[:] = 0
    assert fp.get_one(buf, key, 8192, 4096) == 4096
    assert bool((t[8192 : 8192 + 4096] == 42).all())


def test_the_gil_is_released_while_the_ioctl_runs(fp, key):
    size = 256 << 10
    buf = fp.alloc(64 << 20)
    buf.numpy()[:size] = 5
    assert fp.put_one(buf, key, 0, size) == size
    items = [(key, i * size, size) for i in range(256)]  # 64 MiB in one batch
    ticks = 0
    started, stop = threading.Event(), threading.Event()

    def spin():
        nonlocal ticks
        started.set()
        while not stop.is_set():
            ticks += 1
            stop.wait(0.0005)

    # With this switch interval the interpreter never takes the GIL from the main thread:
    # the spinner runs only while the main thread releases it itself.
    old = sys.getswitchinterval()
    sys.setswitchinterval(1000.0)
    t = threading.Thread(target=spin)
    t.start()
    started.wait()
    during = []
    try:
        for _ in range(20):
            before = ticks
            res = fp.get(buf, items)
            during.append(ticks - before)
            assert res == [(0, size)] * len(items)
            if during[-1] > 0:
                break
    finally:
        stop.set()
        t.join()
        sys.setswitchinterval(old)
    assert max(during) > 0, f"the spinner made no progress during any batch: {during}"


def gone(mount, buf_id):
    """Waits (bounded) until the daemon no longer lists `buf_id`: closing a control file
    reaches the daemon as FUSE's release, which the kernel sends after close(2) returns."""
    wait_until(lambda: buf_id not in registered(mount), timeout=5.0,
               what=f"buffer {buf_id} to leave the daemon")
    return True


def test_close_context_manager_and_collection_unregister(mount):
    fp = kfp.open(mount)
    a, b = fp.alloc(4096), fp.alloc(4096)
    assert {a.id, b.id} <= registered(mount)
    a.close()
    a.close()  # idempotent
    assert a.closed and a.id not in registered(mount) and b.id in registered(mount)
    with pytest.raises(ValueError, match="closed"):
        fp.get(a, [("k", 0, 1)])
    view = a.numpy()
    view[:] = 1  # the memory outlives the registration while views hold it
    fp.close()
    assert fp.closed and b.closed and gone(mount, b.id)
    with pytest.raises(ValueError, match="closed"):
        fp.get(b, [("k", 0, 1)])
    with pytest.raises(ValueError, match="closed"):
        fp.alloc(4096)
    with kfp.open(mount) as fp2:
        c = fp2.alloc(4096)
        assert c.id in registered(mount)
        with pytest.raises(ValueError, match="another FastPath"):
            fp2.get(b, [("k", 0, 1)])
    assert gone(mount, c.id)
    fp3 = kfp.open(mount)
    d = fp3.alloc(4096)
    e_id = fp3.alloc(4096).id  # collected at once
    gc.collect()
    assert e_id not in registered(mount) and d.id in registered(mount)
    del fp3
    gc.collect()
    assert gone(mount, d.id)
    assert d.closed


def test_paths_that_are_not_kvfs_mounts(tmp_path):
    with pytest.raises(OSError, match="no kvfs mount") as e:
        kfp.open(tmp_path / "nowhere")
    assert e.value.errno == errno.ENOENT
    with pytest.raises(OSError, match="not a kvfs mount") as e:
        kfp.open(tmp_path)
    assert e.value.errno == errno.ENOENT
    (tmp_path / ".kvfs").mkdir()
    (tmp_path / ".kvfs" / "control").write_bytes(b"")
    with pytest.raises(OSError, match="not a kvfs mount") as e:
        kfp.open(str(tmp_path))
    assert e.value.errno == errno.ENOTTY
