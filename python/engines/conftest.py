"""A kvfs cluster for the engine driver tests: one ``kvfs master`` and one ``kvfs node``.

The master is started with the reference master's flags (as ``python/tests`` does): a short
read lease (``--default_kv_lease_ttl=500`` ms) so removal tests need not wait long, and a short
``--client_ttl=3`` (s) so a killed process's embedded segment expires quickly. The node
contributes 256 MiB of DRAM. The binary is ``$KVFS_BIN``, else
``$CARGO_TARGET_DIR/{debug,release}/kvfs`` (default target ``/var/tmp/kvfs-target``).

The master's addresses are exported to the environment (``KVFS_ENGINES_MASTER``,
``KVFS_ENGINES_METRICS_PORT``) so the child processes the scenarios start find it too. When
both are already set (scripts/test-engines starts the cluster itself), that cluster is used.

``kvfs_mounts`` is a second, separate cluster for the file backends (test_file_backends.py):
``kvfs up --mount`` (master, node and FUSE mount in one process) and a second ``kvfs mount`` of
it, so a file written through one mount is read through the other. It starts only when a test
asks for it.
"""

import json
import os
import socket
import subprocess
import time
import urllib.request

import pytest

# vLLM refuses to build a VllmConfig on a host without a GPU unless told the device.
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
# LMCache and vLLM ask for these; keep them quiet and off the network.
os.environ.setdefault("LMCACHE_USE_EXPERIMENTAL", "True")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
os.environ.setdefault("DO_NOT_TRACK", "1")

from _common import CLIENT_TTL_S, LEASE_TTL_S  # noqa: E402


def _kvfs_bin():
    explicit = os.environ.get("KVFS_BIN")
    if explicit:
        return explicit
    target = os.environ.get("CARGO_TARGET_DIR", "/var/tmp/kvfs-target")
    for profile in ("debug", "release"):
        path = os.path.join(target, profile, "kvfs")
        if os.access(path, os.X_OK):
            return path
    pytest.exit(f"no kvfs binary under {target}: build it (cargo build --bin kvfs) or set KVFS_BIN")


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _http_get(url, timeout=2.0):
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read()


class Cluster:
    def __init__(self, tmp):
        self.tmp = tmp
        self.bin = _kvfs_bin()
        self.rpc_port = _free_port()
        self.metrics_port = _free_port()
        self.master = f"127.0.0.1:{self.rpc_port}"
        self.procs = []

    def _spawn(self, name, args):
        log = open(os.path.join(self.tmp, f"{name}.log"), "wb")
        p = subprocess.Popen([self.bin, *args], stdout=log, stderr=subprocess.STDOUT)
        self.procs.append(p)
        return p

    def start(self):
        self._spawn(
            "master",
            [
                "master",
                f"--rpc_port={self.rpc_port}",
                "--rpc_address", "127.0.0.1",
                f"--default_kv_lease_ttl={int(LEASE_TTL_S * 1000)}",
                f"--metrics_port={self.metrics_port}",
                "--metrics_host=127.0.0.1",
                f"--client_ttl={CLIENT_TTL_S}",
            ],
        )
        self._wait(lambda: b"ok" in _http_get(f"http://127.0.0.1:{self.metrics_port}/health"),
                   "the master's /health")
        self._spawn("node0", ["--master", self.master, "node", "--dram", "256MiB", "--no-populate"])
        self._wait(lambda: len(self.segments()) >= 1, "the node to register")

    def segments(self):
        return json.loads(_http_get(f"http://127.0.0.1:{self.metrics_port}/get_all_segments"))

    @staticmethod
    def _wait(pred, what, timeout=20.0):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                if pred():
                    return
            except OSError:
                pass
            time.sleep(0.05)
        raise TimeoutError(f"timed out waiting for {what}")

    def stop(self):
        for p in reversed(self.procs):
            if p.poll() is None:
                p.terminate()
        for p in self.procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


class ExternalCluster:
    """The cluster scripts/test-engines started (it exports KVFS_ENGINES_MASTER and
    KVFS_ENGINES_METRICS_PORT and runs the master with the flags Cluster.start uses)."""

    def __init__(self):
        self.master = os.environ["KVFS_ENGINES_MASTER"]
        self.metrics_port = int(os.environ["KVFS_ENGINES_METRICS_PORT"])

    def segments(self):
        return json.loads(_http_get(f"http://127.0.0.1:{self.metrics_port}/get_all_segments"))


def _print_panics(c, names):
    """Shows the tail of a kvfs process log that records a panic."""
    for name in names:
        path = os.path.join(c.tmp, f"{name}.log")
        if os.path.exists(path):
            with open(path, errors="replace") as f:
                tail = f.read()[-1500:]
            if "panicked" in tail:
                print(f"--- {name}.log (tail) ---\n{tail}")


@pytest.fixture(scope="session")
def cluster(tmp_path_factory):
    if os.environ.get("KVFS_ENGINES_MASTER") and os.environ.get("KVFS_ENGINES_METRICS_PORT"):
        c = ExternalCluster()
        Cluster._wait(lambda: len(c.segments()) >= 1, "the external cluster's node")
        yield c
        return
    c = Cluster(str(tmp_path_factory.mktemp("kvfs-engines")))
    try:
        c.start()
        os.environ["KVFS_ENGINES_MASTER"] = c.master
        os.environ["KVFS_ENGINES_METRICS_PORT"] = str(c.metrics_port)
        yield c
    finally:
        c.stop()
        _print_panics(c, ("master", "node0"))


class MountedCluster(Cluster):
    """``kvfs up --mount`` (master, node and FUSE mount in one process) plus ``kvfs mount``s of
    the same cluster at other mount points (``add_mount``): the mounts a file backend writes
    through. Started with the same read lease as ``Cluster``; ``kvfs up`` prints
    ``kvfs is up: master HOST:PORT``, the address the further mounts are given."""

    def __init__(self, tmp):
        super().__init__(tmp)
        self.mounts = []

    def start(self):
        mnt = os.path.join(self.tmp, "mnt0")
        log = os.path.join(self.tmp, "up.log")
        self._spawn(
            "up",
            [
                "up",
                "--data", os.path.join(self.tmp, "data"),
                "--mount", mnt,
                "--listen", self.master,
                "--admin", f"127.0.0.1:{self.metrics_port}",
                f"--lease-ttl-ms={int(LEASE_TTL_S * 1000)}",
                "--dram", "256MiB",
                "--no-populate",
            ],
        )

        def up():
            with open(log, errors="replace") as f:
                text = f.read()
            if "kvfs is up: master " in text and os.path.ismount(mnt):
                return text.split("kvfs is up: master ", 1)[1].split()[0]
            return None

        self._wait(up, f"`kvfs up` to mount {mnt}")
        self.master = up()
        self.mounts.append(mnt)

    def add_mount(self):
        """A further mount of this cluster (``kvfs --master M mount DIR``); returns DIR."""
        mnt = os.path.join(self.tmp, f"mnt{len(self.mounts)}")
        self._spawn(f"mount{len(self.mounts)}", ["--master", self.master, "mount", mnt])
        self._wait(lambda: os.path.ismount(mnt), f"`kvfs mount` of {mnt}")
        self.mounts.append(mnt)
        return mnt

    def stop(self):
        super().stop()  # SIGTERM: each process unmounts its mount point
        for mnt in self.mounts:
            if os.path.ismount(mnt):
                subprocess.run(["fusermount3", "-u", "-z", mnt], check=False)


@pytest.fixture(scope="session")
def kvfs_mounts(tmp_path_factory):
    """Two FUSE mounts of one kvfs cluster: ``mounts[0]`` from ``kvfs up --mount``, ``mounts[1]``
    from ``kvfs mount`` against its master."""
    c = MountedCluster(str(tmp_path_factory.mktemp("kvfs-mounts")))
    try:
        c.start()
        c.add_mount()
        yield c
    finally:
        c.stop()
        _print_panics(c, ("up", "mount1"))


@pytest.fixture
def tag(request):
    """A key prefix unique to the test run and test."""
    return f"{request.node.name.replace('[', '-').replace(']', '')}-{os.getpid()}-{time.time_ns() % 10**9}"
