"""kvfs.reshard against a real master and node: weights stored under one layout, loaded
under others, each fragment equal to the slice numpy cuts from the whole tensor."""

import os

import numpy as np
import pytest

import kvfs
from kvfs import reshard

SPEC = {"tensors": [
    {"name": "embed", "shape": [300, 16], "dtype": "float32", "itemsize": 4, "tp_dim": 0},
    {"name": "l0.qkv", "shape": [48, 16], "dtype": "bfloat16", "itemsize": 2, "tp_dim": 0,
     "layer": [0, 2]},
    {"name": "l1.o", "shape": [16, 48], "dtype": "bfloat16", "itemsize": 2, "tp_dim": 1,
     "layer": [1, 2]},
    {"name": "l1.experts", "shape": [8, 24, 16], "dtype": "float32", "itemsize": 4,
     "tp_dim": 1, "ep_dim": 0, "layer": [1, 2]},
]}


def whole(t):
    n = int(np.prod(t["shape"]))
    dt = np.uint16 if t["dtype"] == "bfloat16" else np.float32
    return (np.arange(n) % 65521).astype(dt).reshape(t["shape"])


@pytest.fixture
def client(cluster):
    with kvfs.Client(cluster.master) as c:
        yield c


def world(layout):
    n = 1
    for part in layout.split("/"):
        n *= int(part[2:])
    return n


def test_weights_stored_under_one_layout_load_under_others(client):
    m = reshard.Model(SPEC)
    name = f"model-{os.getpid()}"
    full = {t["name"]: whole(t) for t in SPEC["tensors"]}
    src = "pp2/ep2/tp2"
    stored = 0
    for p in range(world(src)):
        mine = {t: m.slice(src, p, t, full[t]) for t in m.fragments(src, p)}
        stored += m.store(client, name, src, p, mine)
    assert stored > 0
    m.commit(client, name, src)
    for layout in ["tp4", "ep4/dp2", "tp1"]:
        for p in range(world(layout)):
            got = m.load(client, name, layout, p)
            assert set(got) == set(m.fragments(layout, p))
            for t, arr in got.items():
                np.testing.assert_array_equal(arr, m.slice(layout, p, t, full[t]))
    plan = m.plan(src, "tp4")
    assert plan["regions"] > 0 and plan["bytes"] == sum(a.nbytes for a in full.values())


def test_bad_input_is_a_typed_error_and_stores_nothing(client):
    m = reshard.Model(SPEC)
    name = f"bad-{os.getpid()}"
    with pytest.raises(reshard.ReshardError) as e:
        m.load(client, name, "tp2", 0)
    assert e.value.kind == "not_found"
    with pytest.raises(reshard.ReshardError) as e:
        m.store(client, name, "tp2", 0, {})  # its fragments not given
    assert e.value.kind == "invalid_argument"
    frags = m.fragments("tp2", 0)
    wrong = {t: np.zeros(int(np.prod(s)) + 1, np.uint8) for t, (_, s) in frags.items()}
    with pytest.raises(reshard.ReshardError) as e:
        m.store(client, name, "tp2", 0, wrong)
    assert e.value.kind == "mismatch"
    with pytest.raises(reshard.ReshardError) as e:
        m.plan("tp2", "tq4")
    assert e.value.kind == "invalid_argument"
    bad = {"tensors": [dict(SPEC["tensors"][0], tp_dim=5)]}
    with pytest.raises(reshard.ReshardError) as e:
        reshard.Model(bad).plan("tp2", "tp4")
    assert e.value.kind == "invalid_argument"
    assert isinstance(e.value, kvfs.KvfsError)
