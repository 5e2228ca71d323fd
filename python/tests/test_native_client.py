"""The native API, ``kvfs.Client``, against a real kvfs master and node."""

import json
import time
import urllib.request

import numpy as np
import pytest

import kvfs
from conftest import LEASE_TTL_S


@pytest.fixture
def client(cluster):
    with kvfs.Client(cluster.master) as c:
        yield c
        c.remove_all(force=True)


def test_bytes_round_trip_and_exceptions(client, key):
    client.put(key, b"value")
    client.put(key, b"other, longer")  # first writer wins
    assert client.stat(key)["size"] == len(b"value")  # stat grants no lease
    client.put(key, b"other", upsert=True)
    assert client.get(key) == b"other"
    assert client.exists(key)
    with pytest.raises(kvfs.LeasedError):
        client.put(key, b"x", upsert=True)  # readers hold a lease
    with pytest.raises(kvfs.NotFoundError) as e:
        client.get("missing-" + key)
    assert isinstance(e.value, KeyError) and e.value.code == -704 and e.value.kind == "not_found"
    with pytest.raises(kvfs.LeasedError) as e:
        client.remove(key)
    assert e.value.code == -706 and e.value.retryable
    time.sleep(LEASE_TTL_S + 0.3)
    client.remove(key)
    assert not client.exists(key)
    with pytest.raises(kvfs.InvalidArgumentError):
        client.put(key, b"x", pin="sticky")
    with pytest.raises(ValueError):
        client.put(key, b"x", replicas=0)
    with pytest.raises(TypeError):
        client.put(key, 12345)  # not a buffer


def test_batches_report_per_item(client, key):
    keys = [f"{key}-{i}" for i in range(3)]
    assert client.put_batch(keys, [b"a", bytearray(b"bb"), memoryview(b"ccc")]) == [None] * 3
    got = client.get_batch(keys + ["missing-" + key])
    assert got == [b"a", b"bb", b"ccc", None]
    assert client.exists_batch(keys + ["missing-" + key]) == [True] * 3 + [False]
    res = client.remove_batch(keys + ["missing-" + key], force=True)
    assert res[:3] == [None] * 3 and isinstance(res[3], kvfs.NotFoundError)


def test_zero_copy_with_numpy_and_registration(client, key):
    src = np.random.default_rng(3).integers(0, 255, (4, 65536), dtype=np.uint8)
    dst = np.zeros_like(src)
    with pytest.raises(kvfs.NotRegisteredError):
        client.put_from(key, src[0])
    client.register(src)
    client.register(dst)
    keys = [f"{key}-{i}" for i in range(4)]
    assert client.put_from_batch(keys, list(src)) == [None] * 4
    assert client.get_into_batch(keys, list(dst)) == [65536] * 4
    assert np.array_equal(src, dst)
    client.put_from(key, src.ctypes.data, 100)  # a raw address and a size
    out = np.zeros(100, dtype=np.uint8)
    with pytest.raises(kvfs.NotRegisteredError):
        client.get_into(key, out)
    assert client.get_into(key, dst.ctypes.data, 100) == 100
    with pytest.raises(kvfs.BufferTooSmallError):
        client.get_into(key, dst.ctypes.data, 99)
    res = client.get_into_batch([key, "missing-" + key], [dst[0], dst[1]])
    assert res[0] == 100 and isinstance(res[1], kvfs.NotFoundError)
    client.unregister(src)
    client.unregister(dst.ctypes.data)
    with pytest.raises(kvfs.InvalidArgumentError):
        client.unregister(dst)


def test_list_stat_and_remove_counts(client, key):
    for i in range(3):
        client.put(f"{key}/k{i}", bytes(10 + i), pin="hard" if i == 0 else "none")
    entries, nxt = client.list(prefix=f"{key}/")
    assert entries == [(f"{key}/k0", 10), (f"{key}/k1", 11), (f"{key}/k2", 12)] and nxt is None
    page, nxt = client.list(prefix=f"{key}/", limit=2)
    assert len(page) == 2 and nxt == f"{key}/k1"
    st = client.stat(f"{key}/k0")
    assert st["size"] == 10 and st["pin"] == "hard" and st["replicas"][0]["tier"] == "dram"
    counts = client.remove_regex(f"^{key}/")
    assert counts == {"removed": 2, "skipped_leased": 0, "skipped_pinned": 1}
    assert client.remove_all(force=True)["removed"] >= 1


def test_embedded_segment_and_endpoint(cluster, key):
    with kvfs.Client(cluster.master, segment_bytes=16 << 20, local_hostname="localhost") as c:
        assert c.endpoint.startswith("localhost:") and c.endpoint in cluster.segments()
        c.put(key, b"local", preferred=[c.endpoint])
        assert c.stat(key)["replicas"][0]["endpoint"] == c.endpoint
        assert c.get(key) == b"local"
    with pytest.raises(kvfs.NotConnectedError):
        c.get(key)


def test_staging_bound(cluster, key):
    with kvfs.Client(cluster.master, staging_bytes_max=64 << 10) as c:
        with pytest.raises(kvfs.InvalidArgumentError):
            c.put(key, bytes(128 << 10))
        c.put(key, bytes(64 << 10))
        # Values from 256 KiB are written from (and read into) the caller's objects: no staging.
        big = bytes(range(256)) * (8 << 10)
        c.put(key + "-big", big)
        assert c.get(key + "-big") == big
        assert c.get_batch([key + "-big", key]) == [big, bytes(64 << 10)]


def test_master_reference_flags_took_effect(cluster):
    # --metrics_port serves the admin endpoints; SGLang polls /get_all_segments.
    assert len(cluster.segments()) >= 1
    # --enable_http_metadata_server serves the reference's metadata protocol.
    base = f"http://127.0.0.1:{cluster.metadata_port}/metadata?key=mooncake/ram/seg"
    req = urllib.request.Request(base, data=json.dumps({"a": 1}).encode(), method="PUT")
    assert urllib.request.urlopen(req, timeout=2).read() == b"metadata updated"
    assert json.loads(urllib.request.urlopen(base, timeout=2).read()) == {"a": 1}
    req = urllib.request.Request(base, method="DELETE")
    assert urllib.request.urlopen(req, timeout=2).read() == b"metadata deleted"
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(base, timeout=2)
    assert e.value.code == 404


def test_rename_and_unlink(client, key):
    src, dst = f"{key}/tmp", f"{key}/final"
    client.put(src, b"new bytes")
    client.put(dst, b"old")
    assert client.get(dst) == b"old"  # a reader now holds a lease on dst
    with pytest.raises(kvfs.AlreadyExistsError):
        client.rename(src, dst, replace=False)
    before = client.stat(src)["version"]
    version = client.rename(src, dst)  # replaces dst even under the lease
    assert version > before
    assert client.get(dst) == b"new bytes"
    assert not client.exists(src)
    with pytest.raises(kvfs.NotFoundError):
        client.rename(src, dst)
    # unlink takes the name at once even while leased; remove refuses
    with pytest.raises(kvfs.LeasedError):
        client.remove(dst)
    client.unlink(dst)
    assert not client.exists(dst)
    with pytest.raises(kvfs.NotFoundError):
        client.unlink(dst)
