"""Helpers shared by the engine driver tests and the child processes they start.

Each ``test_<engine>.py`` is also a script: run as ``python test_<engine>.py ROLE JSON`` it
plays one process of a cross-process scenario (a producer, a consumer, a prefill or decode
worker) with the engine's real class. The parent talks to it over a line protocol: the child
prints ``EVENT <name> <json>`` lines and, when it holds state (a live embedded segment, a
registered KV cache), waits for ``quit`` on its stdin before it closes and exits.

The cluster's addresses reach children through the environment: ``KVFS_ENGINES_MASTER``
(``host:port`` of the kvfs master) and ``KVFS_ENGINES_METRICS_PORT`` (its admin HTTP port,
which serves the reference's ``/get_all_segments``).
"""

import hashlib
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time

MIB = 1 << 20
# The read lease and the segment-owner TTL the cluster's master runs with (conftest.py).
LEASE_TTL_S = 0.5
CLIENT_TTL_S = 3


def master_addr():
    return os.environ["KVFS_ENGINES_MASTER"]


def metrics_port():
    return int(os.environ["KVFS_ENGINES_METRICS_PORT"])


def pattern(tag, index, nbytes):
    """Deterministic bytes for object ``index`` of a run tagged ``tag`` (both sides compute it)."""
    out = hashlib.shake_256(f"{tag}/{index}".encode()).digest(nbytes)
    return out


def emit(name, **payload):
    """Child side: report an event to the parent."""
    print(f"EVENT {name} {json.dumps(payload)}", flush=True)


def wait_for_quit():
    """Child side: block until the parent writes ``quit`` (or closes stdin)."""
    for line in sys.stdin:
        if line.strip() == "quit":
            return


def child_main(roles):
    """Child side entry: ``python test_x.py ROLE JSON`` runs ``roles[ROLE](**json)``."""
    role, args = sys.argv[1], json.loads(sys.argv[2]) if len(sys.argv) > 2 else {}
    try:
        roles[role](**args)
    except BaseException as e:  # the parent reads the reason from the event stream
        import traceback

        traceback.print_exc()
        emit("error", error=f"{type(e).__name__}: {e}")
        sys.stdout.flush()
        os._exit(3)
    sys.stdout.flush()
    # Engines leave non-daemon threads (transfer threads, event loops): do not wait for them.
    os._exit(0)


class Child:
    """Parent side: one child process of a scenario, started from a driver test file."""

    def __init__(self, script, role, timeout=120, env=None, **args):
        full_env = dict(os.environ)
        full_env.update(env or {})
        self.role = role
        self.timeout = timeout
        self.lines = []
        self._queue = queue.Queue()
        self.proc = subprocess.Popen(
            [sys.executable, script, role, json.dumps(args)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=full_env,
            bufsize=1,
        )
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self):
        for line in self.proc.stdout:
            self._queue.put(line)
        self._queue.put(None)

    def wait_event(self, name, timeout=None):
        """Reads the child's output until ``EVENT name``; returns its payload."""
        deadline = time.monotonic() + (timeout or self.timeout)
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                self.kill()
                raise TimeoutError(f"{self.role}: no '{name}' event in time:\n{self.output()}")
            try:
                line = self._queue.get(timeout=min(left, 1.0))
            except queue.Empty:
                continue
            if line is None:
                code = self.proc.wait()
                raise RuntimeError(
                    f"{self.role} exited ({code}) before '{name}':\n{self.output()}"
                )
            self.lines.append(line)
            if line.startswith("EVENT "):
                _, ev, payload = line.rstrip("\n").split(" ", 2)
                if ev == "error":
                    self.proc.wait(timeout=10)
                    raise RuntimeError(f"{self.role} failed: {payload}\n{self.output()}")
                if ev == name:
                    return json.loads(payload)

    def send(self, line):
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def finish(self, timeout=None):
        """Tells a holding child to close and exit; asserts it exited 0."""
        try:
            self.send("quit")
        except (BrokenPipeError, OSError):
            pass
        try:
            self.proc.wait(timeout=timeout or self.timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise
        self._reader.join(timeout=5)
        while True:
            try:
                line = self._queue.get_nowait()
            except queue.Empty:
                break
            if line is not None:
                self.lines.append(line)
        assert self.proc.returncode == 0, (
            f"{self.role} exited {self.proc.returncode}:\n{self.output()}"
        )

    def sigkill(self):
        """SIGKILL, as a crashed engine process: no close, no unregister, nothing flushed."""
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=10)

    def kill(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)

    def output(self):
        return "".join(self.lines)[-6000:]
