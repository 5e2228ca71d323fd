"""HBM from the Python package: in the reference's API (kvfs extensions) a store's embedded node
also contributes GPU memory with ``hbm_segment_size`` (or ``KVFS_HBM_SEGMENT_SIZE``), and a put
asks for it with ``ReplicateConfig.tier = "hbm"``; in kvfs's own ``kvfs.Client`` the same are
``hbm_bytes=`` and ``tier="hbm"``.

Without a CUDA driver (CI) the refusals are what can be checked: setup says no and leaves the
store usable, and a put asking for HBM where no node has any fails and leaves nothing. With a
driver the bytes go through GPU memory and back."""

import ctypes

import pytest

import kvfs
from kvfs import ERROR_CODES
from kvfs.mooncake import INVALID_PARAMS
from mooncake.store import MooncakeDistributedStore, ReplicateConfig

MIB = 1 << 20


def driver_present():
    try:
        ctypes.CDLL("libcuda.so.1")
        return True
    except OSError:
        return False


def config(master, **extra):
    cfg = {
        "local_hostname": "localhost",
        "metadata_server": "P2PHANDSHAKE",
        "global_segment_size": 16 * MIB,
        "local_buffer_size": 16 * MIB,
        "protocol": "tcp",
        "master_server_address": master,
    }
    cfg.update(extra)
    return cfg


@pytest.mark.skipif(driver_present(), reason="a CUDA driver is present")
def test_without_a_driver_an_hbm_segment_is_refused_and_the_store_still_sets_up(
        cluster, monkeypatch):
    s = MooncakeDistributedStore()
    try:
        assert s.setup(config(cluster.master, hbm_segment_size="64MB")) < 0
        # The environment variable reaches the reference's positional form too.
        monkeypatch.setenv("KVFS_HBM_SEGMENT_SIZE", "64MB")
        rc = s.setup("localhost", "P2PHANDSHAKE", 16 * MIB, 16 * MIB, "tcp", "", cluster.master)
        assert rc < 0
        monkeypatch.delenv("KVFS_HBM_SEGMENT_SIZE")
        assert s.setup(config(cluster.master)) == 0
        assert s.put("hbm-refused/after", b"bytes") == 0
        assert s.get("hbm-refused/after") == b"bytes"
        assert s.remove("hbm-refused/after", force=True) == 0
    finally:
        s.close()


def test_bad_hbm_settings_are_invalid_params(cluster):
    s = MooncakeDistributedStore()
    try:
        # GPU memory is contributed beside DRAM, never alone.
        no_dram = config(cluster.master, global_segment_size=0, hbm_segment_size="64MB")
        assert s.setup(no_dram) == INVALID_PARAMS
        assert s.setup(config(cluster.master, hbm_segment_size="lots")) == INVALID_PARAMS
    finally:
        s.close()


def test_a_put_asking_for_hbm_where_no_node_has_any_fails_and_leaves_nothing(store, key):
    if driver_present():
        pytest.skip("a CUDA driver is present: nodes may contribute HBM")
    cfg = ReplicateConfig()
    assert cfg.tier == "dram" and "tier='dram'" in str(cfg)
    cfg.tier = "hbm"
    assert store.put(key, b"gpu bytes", cfg) == ERROR_CODES["NO_AVAILABLE_HANDLE"]
    assert store.is_exist(key) == 0
    assert store.get(key) == b""
    cfg.tier = "ssd"
    assert store.put(key, b"gpu bytes", cfg) == INVALID_PARAMS
    cfg.tier = "dram"
    assert store.put(key, b"dram bytes", cfg) == 0
    assert store.get(key) == b"dram bytes"


@pytest.mark.skipif(not driver_present(), reason="no CUDA driver: run on a GPU machine")
def test_on_a_gpu_puts_asking_for_hbm_live_in_this_process_gpu_memory(cluster, key):
    s = MooncakeDistributedStore()
    assert s.setup(config(cluster.master, hbm_segment_size="256MB")) == 0
    try:
        cfg = ReplicateConfig()
        cfg.tier = "hbm"
        cfg.preferred_segment = s.get_hostname()
        values = {f"{key}/{n}": bytes([n % 251]) * n for n in (1, 4096, 3 * MIB + 5)}
        for k, v in values.items():
            assert s.put(k, v, cfg) == 0, k
        for k, v in values.items():
            assert s.get(k) == v, k
        s.remove_all(force=True)
    finally:
        s.close()


def test_the_native_client_refuses_what_it_cannot_place_and_keeps_nothing(cluster, key):
    with kvfs.Client(cluster.master) as c:
        with pytest.raises(kvfs.InvalidArgumentError):
            c.put(key, b"x", tier="ssd")
        if not driver_present():
            with pytest.raises(kvfs.KvfsError) as e:
                c.put(key, b"gpu bytes", tier="hbm")
            assert e.value.kind == "no_space", e.value
            assert not c.exists(key)
        c.put(key, b"dram bytes", tier="dram")
        assert c.get(key) == b"dram bytes"
        c.remove(key, force=True)
    if not driver_present():
        with pytest.raises(kvfs.KvfsError) as e:
            kvfs.Client(cluster.master, segment_bytes=16 * MIB, hbm_bytes=64 * MIB)
        assert "CUDA" in str(e.value), e.value


@pytest.mark.skipif(not driver_present(), reason="no CUDA driver: run on a GPU machine")
def test_on_a_gpu_the_native_client_puts_into_its_own_gpu_memory(cluster, key):
    with kvfs.Client(cluster.master, segment_bytes=16 * MIB, hbm_bytes=256 * MIB,
                     local_hostname="localhost") as c:
        v = bytes(range(256)) * (12 * 1024)
        c.put(key, v, tier="hbm", preferred=[c.endpoint])
        assert [r["tier"] for r in c.stat(key)["replicas"]] == ["hbm"]
        assert c.get(key) == v
        c.remove(key, force=True)
