"""Fixtures: a real kvfs cluster (master and node processes of the `kvfs` binary) per session.

The binary comes from ``$KVFS_BIN``, else ``$CARGO_TARGET_DIR/{debug,release}/kvfs`` (default
target dir ``/var/tmp/kvfs-target``, as scripts/test uses). The master is started with the
reference master's flags (gflags style), so the tests also prove those flags take effect:
the read lease is ``--default_kv_lease_ttl=500`` (ms), the admin port ``--metrics_port`` and
the HTTP metadata server ``--enable_http_metadata_server``.
"""

import os
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

LEASE_TTL_S = 0.5


def kvfs_bin():
    explicit = os.environ.get("KVFS_BIN")
    if explicit:
        return explicit
    target = os.environ.get("CARGO_TARGET_DIR", "/var/tmp/kvfs-target")
    for profile in ("debug", "release"):
        path = os.path.join(target, profile, "kvfs")
        if os.access(path, os.X_OK):
            return path
    pytest.exit(f"no kvfs binary under {target}: build it (cargo build --bin kvfs) or set KVFS_BIN")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until(pred, timeout=15.0, what="condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if pred():
                return
        except OSError:
            pass
        time.sleep(0.05)
    raise TimeoutError(f"timed out waiting for {what}")


def http_get(url, timeout=2.0):
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read()


class Cluster:
    """A master and nodes started as subprocesses; stopped by ``stop``."""

    def __init__(self, tmp):
        self.tmp = tmp
        self.bin = kvfs_bin()
        self.rpc_port = free_port()
        self.metrics_port = free_port()
        self.metadata_port = free_port()
        self.master = f"127.0.0.1:{self.rpc_port}"
        self.procs = []

    def _spawn(self, name, args):
        log = open(os.path.join(self.tmp, f"{name}.log"), "wb")
        p = subprocess.Popen([self.bin, *args], stdout=log, stderr=subprocess.STDOUT)
        self.procs.append(p)
        return p

    def start_master(self):
        self._spawn(
            "master",
            [
                "master",
                f"--rpc_port={self.rpc_port}",
                "--rpc_address", "127.0.0.1",
                "--default_kv_lease_ttl=500",
                f"--metrics_port={self.metrics_port}",
                "--metrics_host=127.0.0.1",
                "--enable_http_metadata_server",
                f"--http_metadata_server_port={self.metadata_port}",
                "--http_metadata_server_host=127.0.0.1",
                "--client_ttl=3",
                "--rpc_thread_num=4",
                "--enable_metric_reporting=true",
            ],
        )
        wait_until(lambda: self.health(), what="the master's /health")

    def start_node(self, dram="128MiB"):
        n = len([p for p in self.procs]) - 1
        self._spawn(f"node{n}", ["--master", self.master, "node", "--dram", dram, "--no-populate"])

    def health(self):
        return b"ok" in http_get(f"http://127.0.0.1:{self.metrics_port}/health")

    def segments(self):
        import json

        return json.loads(http_get(f"http://127.0.0.1:{self.metrics_port}/get_all_segments"))

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


@pytest.fixture(scope="session")
def cluster(tmp_path_factory):
    c = Cluster(str(tmp_path_factory.mktemp("kvfs")))
    try:
        c.start_master()
        c.start_node()
        wait_until(lambda: len(c.segments()) >= 1, what="the node to register")
        yield c
    finally:
        c.stop()


@pytest.fixture
def store(cluster):
    """A set-up MooncakeDistributedStore (pure client: the node holds the data)."""
    from mooncake.store import MooncakeDistributedStore

    s = MooncakeDistributedStore()
    rc = s.setup("localhost", "P2PHANDSHAKE", 0, 64 << 20, "tcp", "", cluster.master)
    assert rc == 0
    yield s
    s.remove_all(force=True)
    s.close()


@pytest.fixture
def key(request):
    """A key unique to the test."""
    return f"{request.node.name}-{os.getpid()}"


def run_python(code, env=None, timeout=60):
    """Runs ``code`` in a fresh Python process (spawned, not forked); returns its stdout."""
    full_env = dict(os.environ)
    full_env.update(env or {})
    r = subprocess.run(
        [sys.executable, "-c", code],
        env=full_env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert r.returncode == 0, f"child failed:\n{r.stdout}\n{r.stderr}"
    return r.stdout
