"""The reference's ``tenant_id`` from the Python package: a store set up with a tenant writes
into its own namespace and is held to the quota the master was given
(``--tenant-quota``): over it, its own oldest objects make room, and a put that cannot fit
returns the reference's TENANT_QUOTA_EXCEEDED (-1700)."""

import json
import os
import shutil
import socket
import subprocess
import tempfile
import urllib.request

import pytest

from conftest import free_port, kvfs_bin, wait_until
from mooncake.store import MooncakeDistributedStore

MIB = 1 << 20


@pytest.fixture
def master():
    tmp = tempfile.mkdtemp(prefix="kvfs-tenants-")
    port, admin = free_port(), free_port()
    log = open(os.path.join(tmp, "master.log"), "wb")
    p = subprocess.Popen(
        [kvfs_bin(), "master", "--listen", f"127.0.0.1:{port}", "--admin", f"127.0.0.1:{admin}",
         "--tenant-quota", "acme=4MiB"],
        stdout=log, stderr=subprocess.STDOUT)
    try:
        def listening():
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return True

        wait_until(listening, what="the master")
        yield f"127.0.0.1:{port}", f"127.0.0.1:{admin}"
    finally:
        p.kill()
        p.wait()
        shutil.rmtree(tmp, ignore_errors=True)


def store(master, tenant):
    s = MooncakeDistributedStore()
    rc = s.setup("localhost", "P2PHANDSHAKE", 64 * MIB, 32 * MIB, "tcp", "", master,
                 tenant_id=tenant)
    assert rc == 0
    return s


def test_a_tenant_has_its_own_namespace_and_quota(master):
    addr, admin = master
    acme = store(addr, "acme")
    shared = store(addr, "default")
    try:
        for i in range(10):
            assert acme.put(f"k{i}", bytes([i]) * MIB) == 0, f"k{i}"
        assert acme.get("k9") == bytes([9]) * MIB
        assert acme.is_exist("k0") == 0, "the oldest made room"
        assert shared.is_exist("k9") == 0, "the default namespace is another one"
        assert shared.get("tenants/acme/k9") == bytes([9]) * MIB, "an admin sees it by its full name"
        assert acme.put("huge", b"x" * (5 * MIB)) == -1700
        with urllib.request.urlopen(f"http://{admin}/api/v1/tenant_quotas?tenant_id=acme") as r:
            u = json.load(r)
        assert u["quota_bytes"] == 4 * MIB and u["memory_bytes"] <= 4 * MIB, u
        assert u["refused_puts"] == 1, u
    finally:
        acme.close()
        shared.close()
