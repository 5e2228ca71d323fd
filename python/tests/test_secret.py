"""The cluster secret from the Python package: a store whose process has
``KVFS_CLUSTER_SECRET_FILE`` joins a cluster started with ``--cluster-secret-file`` and moves
bytes; one without it (or with another secret) fails setup with a code, and the cluster keeps
serving the holder."""

import os
import shutil
import subprocess
import tempfile

import pytest

from conftest import free_port, kvfs_bin, wait_until
from mooncake.store import MooncakeDistributedStore


@pytest.fixture
def guarded():
    tmp = tempfile.mkdtemp(prefix="kvfs-secret-")
    secret = os.path.join(tmp, "secret")
    with open(secret, "w") as f:
        f.write("a python cluster secret of 32 bytes\n")
    port = free_port()
    log = open(os.path.join(tmp, "master.log"), "wb")
    master = subprocess.Popen(
        [kvfs_bin(), "master", "--admin", "off", "--listen", f"127.0.0.1:{port}",
         "--cluster-secret-file", secret],
        stdout=log, stderr=subprocess.STDOUT)
    saved = os.environ.pop("KVFS_CLUSTER_SECRET_FILE", None)
    try:
        import socket

        def listening():
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return True

        wait_until(listening, what="the master")
        yield f"127.0.0.1:{port}", secret, tmp
    finally:
        os.environ.pop("KVFS_CLUSTER_SECRET_FILE", None)
        if saved is not None:
            os.environ["KVFS_CLUSTER_SECRET_FILE"] = saved
        master.kill()
        master.wait()
        shutil.rmtree(tmp, ignore_errors=True)


def setup(master):
    s = MooncakeDistributedStore()
    return s, s.setup("localhost", "P2PHANDSHAKE", 64 << 20, 16 << 20, "tcp", "", master)


def test_only_a_process_with_the_secret_joins(guarded):
    master, secret, tmp = guarded
    os.environ["KVFS_CLUSTER_SECRET_FILE"] = secret
    holder, rc = setup(master)
    assert rc == 0
    try:
        value = os.urandom(300_000)
        assert holder.put("guarded", value) == 0
        assert holder.get("guarded") == value

        os.environ.pop("KVFS_CLUSTER_SECRET_FILE")
        stranger, rc = setup(master)
        assert rc != 0, "a store without the secret must not join"

        other = os.path.join(tmp, "other")
        with open(other, "w") as f:
            f.write("the secret of some other cluster\n")
        os.environ["KVFS_CLUSTER_SECRET_FILE"] = other
        stranger, rc = setup(master)
        assert rc != 0, "a store with another secret must not join"

        os.environ["KVFS_CLUSTER_SECRET_FILE"] = os.path.join(tmp, "missing")
        stranger, rc = setup(master)
        assert rc != 0, "a secret file that does not exist is an error, not no secret"

        assert holder.get("guarded") == value
    finally:
        holder.close()
