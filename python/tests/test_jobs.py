"""Offload and restore jobs from Python (``kvfs.Client.offload/restore/job/jobs/cancel_job``)
against a real master and node that share a local object store."""

import json
import os
import subprocess

import pytest

import kvfs
from conftest import free_port, http_get, kvfs_bin, wait_until


@pytest.fixture(scope="module")
def persisted_cluster(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("jobs"))
    store = f"fs:{os.path.join(tmp, 'objects')}"
    port, admin = free_port(), free_port()
    master = f"127.0.0.1:{port}"
    logs = [open(os.path.join(tmp, f"{n}.log"), "wb") for n in ("master", "node")]
    procs = [
        subprocess.Popen(
            [kvfs_bin(), "master", "--listen", master, "--admin", f"127.0.0.1:{admin}",
             "--object-store", store, "--recovery-grace-ms", "500"],
            stdout=logs[0], stderr=subprocess.STDOUT,
        )
    ]
    try:
        wait_until(lambda: b"ok" in http_get(f"http://127.0.0.1:{admin}/health"),
                   what="the master's /health")
        procs.append(subprocess.Popen(
            [kvfs_bin(), "--master", master, "node", "--dram", "128MiB", "--no-populate",
             "--object-store", store],
            stdout=logs[1], stderr=subprocess.STDOUT,
        ))
        segments = f"http://127.0.0.1:{admin}/get_all_segments"
        wait_until(lambda: len(json.loads(http_get(segments))) >= 1, what="the node to register")
        yield master
    finally:
        for p in procs:
            p.kill()
            p.wait()


def wait_job(c, job_id, timeout=30.0):
    wait_until(lambda: c.job(job_id)["state"] != "running", timeout=timeout, what="the job")
    return c.job(job_id)


def test_offload_move_and_restore(persisted_cluster):
    with kvfs.Client(persisted_cluster) as c:
        values = {f"py/{i}": os.urandom(10_000 + i) for i in range(40)}
        for k, v in values.items():
            c.put(k, v)
        j = c.offload("py/")
        s = wait_job(c, j)
        assert s["state"] == "done" and s["kind"] == "offload" and s["prefix"] == "py/", s
        assert (s["objects_total"], s["moved"], s["failed"]) == (40, 40, 0), s
        assert s["bytes_total"] == sum(len(v) for v in values.values())
        assert all(r["tier"] == "objectstore" for r in c.stat("py/3")["replicas"]
                   if r["tier"] != "dram") and any(
            r["tier"] == "objectstore" for r in c.stat("py/3")["replicas"])

        s = wait_job(c, c.offload("py/", move=True))
        assert (s["kind"], s["already"], s["evicted"], s["kept"]) == ("offload --move", 40, 40, 0), s
        assert [r["tier"] for r in c.stat("py/5")["replicas"]] == ["objectstore"]

        s = wait_job(c, c.restore("py/", concurrency=4))
        assert (s["state"], s["moved"]) == ("done", 40), s
        for k, v in values.items():
            assert c.get(k) == v
        assert {j["id"] for j in c.jobs()} >= {s["id"]}


def test_bad_input_and_cancel(persisted_cluster):
    with kvfs.Client(persisted_cluster) as c:
        with pytest.raises(kvfs.InvalidArgumentError):
            c.offload("q/", concurrency=0)
        with pytest.raises(kvfs.NotFoundError):
            c.job(12345)
        for i in range(30):
            c.put(f"q/{i}", os.urandom(20_000))
        j = c.offload("q/", rate=50_000)
        wait_until(lambda: c.job(j)["objects_done"] > 0, what="progress")
        c.cancel_job(j)
        s = wait_job(c, j)
        assert s["state"] == "cancelled" and s["objects_done"] < 30, s
