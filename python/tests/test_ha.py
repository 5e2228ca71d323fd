"""The reference's HA master address (``master_server_addr="etcd://..."``) from the Python
package: two kvfs masters started with the reference's HA flags elect a leader through a real
etcd; the store follows it, and keeps working, objects intact, after the leader is killed."""

import os
import shutil
import signal
import subprocess
import tempfile
import time

import numpy as np
import pytest

from conftest import free_port, kvfs_bin, wait_until
from mooncake.store import MooncakeDistributedStore

class Etcd:
    def __init__(self, tmp):
        self.client = free_port()
        peer = free_port()
        url, purl = f"http://127.0.0.1:{self.client}", f"http://127.0.0.1:{peer}"
        self.log = open(os.path.join(tmp, "etcd.log"), "wb")
        self.proc = subprocess.Popen(
            ["etcd", "--name", "p", "--data-dir", os.path.join(tmp, "etcd"),
             "--listen-client-urls", url, "--advertise-client-urls", url,
             "--listen-peer-urls", purl, "--initial-advertise-peer-urls", purl,
             "--initial-cluster", f"p={purl}",
             "--heartbeat-interval", "50", "--election-timeout", "500"],
            stdout=self.log, stderr=subprocess.STDOUT)
        import urllib.request

        def healthy():
            with urllib.request.urlopen(f"{url}/health", timeout=1) as r:
                return b'"true"' in r.read()

        wait_until(healthy, timeout=20, what="etcd")

    def leader_term(self):
        import base64
        import json
        import urllib.request

        key = base64.b64encode(b"/kvfs/mooncake_cluster/leader").decode()
        req = urllib.request.Request(
            f"http://127.0.0.1:{self.client}/v3/kv/range",
            data=json.dumps({"key": key}).encode(), method="POST")
        with urllib.request.urlopen(req, timeout=2) as r:
            kvs = json.load(r).get("kvs") or []
        return int(kvs[0]["create_revision"]) if kvs else 0


@pytest.fixture
def ha():
    tmp = tempfile.mkdtemp(prefix="kvfs-ha-")
    etcd = Etcd(tmp)
    masters = []
    try:
        for i in range(2):
            port = free_port()
            log = open(os.path.join(tmp, f"master{i}.log"), "wb")
            p = subprocess.Popen(
                [kvfs_bin(), "master", "--admin", "off", "--enable_ha=true",
                 f"--etcd_endpoints=127.0.0.1:{etcd.client}", f"--rpc_port={port}",
                 "--rpc_address", "127.0.0.1", "--recovery-grace-ms", "1000"],
                stdout=log, stderr=subprocess.STDOUT)
            masters.append(p)
            if i == 0:
                wait_until(lambda: etcd.leader_term() > 0, what="a leader")
        yield etcd, masters
    finally:
        for p in masters:
            if p.poll() is None:
                p.kill()
            p.wait()
        etcd.proc.kill()
        etcd.proc.wait()
        shutil.rmtree(tmp, ignore_errors=True)


def test_the_store_follows_the_leader_through_etcd(ha):
    etcd, masters = ha
    s = MooncakeDistributedStore()
    # The reference's spelling: endpoints after etcd://, the default cluster id.
    addr = f"etcd://127.0.0.1:{etcd.client}"
    assert s.setup("localhost", "P2PHANDSHAKE", 64 << 20, 16 << 20, "tcp", "", addr) == 0
    try:
        values = {f"ha-{i}": np.random.default_rng(i).bytes(5000 + i) for i in range(20)}
        for k, v in values.items():
            assert s.put(k, v) == 0
        term = etcd.leader_term()
        masters[0].send_signal(signal.SIGKILL)
        masters[0].wait()
        wait_until(lambda: etcd.leader_term() > term, timeout=20, what="a new leader")
        # The objects live in this process's segment; the new leader learns of them when the
        # embedded node registers with it.
        deadline = time.monotonic() + 20
        for k, v in values.items():
            while s.get(k) != v:
                assert time.monotonic() < deadline, f"{k} never came back"
                time.sleep(0.05)
        deadline = time.monotonic() + 20
        while s.put("ha-after", b"x" * 1000) != 0:
            assert time.monotonic() < deadline, "no put through the new leader"
            time.sleep(0.05)
        assert s.get("ha-after") == b"x" * 1000
        assert s.is_exist("ha-0") == 1
    finally:
        s.close()
