"""Process groups on the kvfs Transfer Engine: collectives and point-to-point with stable
rank slots and elastic membership.

A group has one coordinator (``Coordinator``; rank 0 usually hosts it) and members
(``Group``), each in its own process, addressed by *slots* that are never renumbered::

    import numpy as np
    from kvfs import pg

    coord = pg.Coordinator(world=4) if slot == 0 else None   # publish coord.addr to the others
    g = pg.Group(addr, slot=slot, world=4)                    # blocks until all 4 joined
    a = np.full(1 << 20, slot, dtype=np.float32)
    g.allreduce(a)                                            # in place, sum by default
    out = g.allgather(np.arange(4, dtype=np.int64))           # (n_active * 4,) array

Any C-contiguous buffer-protocol object works (numpy arrays, bytearrays); the dtype is
taken from numpy arrays or passed as ``dtype=`` ("float32", "float64", "float16",
"bfloat16", "int32", "int64", "uint8"). Reductions: "sum", "product", "min", "max", "avg",
folded in slot order, so results are the same bits on every rank and every run.

Failures: a member that dies is removed by the coordinator; the survivors' next call runs
over the survivors (an interrupted call is run again or fails with ``PeerFailed`` on all of
them alike). A replacement process joins the old slot with ``Group(addr, slot, world)``, which
returns once the active members call ``change(activate=[slot])``. Every call ends within its
deadline with a :class:`PgError` whose ``kind`` is one of ``invalid_argument``, ``mismatch``
(ranks called with different sizes, dtypes, ops or roots), ``unknown_slot``, ``peer_failed``,
``stale_epoch``, ``timeout``, ``refused``, ``closed``, ``busy``, ``transfer``.

Where torch is installed, importing this module registers the ``torch.distributed`` backend
``"kvfs"`` (see :mod:`kvfs.torch_pg`).
"""

import atexit
import weakref

from kvfs._native import PgCoordinator as _Coordinator, PgGroup as _Group

__all__ = ["Coordinator", "Group", "PgError", "dtype_name"]


class PgError(RuntimeError):
    """A process-group call failed; ``kind`` says how, ``retryable`` whether the same call
    may succeed later (after a view change)."""

    def __init__(self, message, kind="transfer", retryable=False):
        super().__init__(message)
        self.kind = kind
        self.retryable = retryable


class PgTimeoutError(PgError, TimeoutError):
    """No progress within the call's deadline."""


def _error(kind, message, retryable):
    cls = PgTimeoutError if kind == "timeout" else PgError
    return cls(message, kind, retryable)


_NUMPY_NAMES = {
    "float32": "float32",
    "float64": "float64",
    "float16": "float16",
    "int32": "int32",
    "int64": "int64",
    "uint8": "uint8",
}


def dtype_name(buf, dtype=None):
    """The element type of ``buf`` as kvfs-pg names it."""
    if dtype is not None:
        return str(dtype).replace("torch.", "")
    dt = getattr(buf, "dtype", None)
    if dt is None:
        return "uint8"
    name = str(dt).replace("torch.", "")
    if name not in _NUMPY_NAMES and name != "bfloat16":
        raise PgError(f"dtype {name} is not supported", "invalid_argument")
    return name


def _empty_like(buf, count):
    import numpy as np

    return np.empty(count, dtype=buf.dtype)


class Coordinator:
    """The group's coordinator (decides views; holds no data). Keep it alive as long as the
    group: when it is gone, operations continue but membership can no longer change."""

    def __init__(self, world, group="default", listen="127.0.0.1:0", max_group_size=1024,
                 heartbeat_ms=200, failure_timeout_ms=3000):
        self._c = _Coordinator(world, group, listen, max_group_size, heartbeat_ms,
                               failure_timeout_ms)

    @property
    def addr(self):
        return self._c.addr

    def view(self):
        return self._c.view()

    def pending(self):
        return self._c.pending()


class Group:
    """One member of a process group (see the module notes)."""

    def __init__(self, coordinator, slot, world, group="default", listen="127.0.0.1:0",
                 staging_bytes=16 << 20, inline_bytes_max=32 << 10, op_timeout_ms=30_000,
                 join_timeout_ms=60_000, tcp_only=False, wait_active=True):
        self._g = _Group(str(coordinator), slot, world, group, listen, staging_bytes,
                         inline_bytes_max, op_timeout_ms, join_timeout_ms, tcp_only,
                         wait_active)
        self._closed = False
        _OPEN.add(self)

    @property
    def pending(self):
        """True for a late joiner not yet activated (its calls run over itself alone)."""
        return self._g.is_pending()

    def wait_active(self, timeout_s=600):
        """Waits until the active members activate this late joiner; returns the view."""
        return self._g.wait_active(int(timeout_s * 1000))

    # -- the group ---------------------------------------------------------------------
    @property
    def slot(self):
        return self._g.slot

    def view(self):
        """``{"epoch", "world", "active": [slots], "removed": [(slot, evidence)]}``."""
        return self._g.view()

    @property
    def epoch(self):
        return self._g.view()["epoch"]

    @property
    def active(self):
        return self._g.view()["active"]

    @property
    def rank(self):
        """This member's index among the active slots."""
        return self.active.index(self.slot)

    @property
    def size(self):
        return len(self.active)

    def counters(self):
        return self._g.counters()

    def change(self, activate=(), deactivate=()):
        """Called by every active member between the same two operations: activates pending
        joiners and deactivates members; returns the new view."""
        return self._g.change(list(activate), list(deactivate))

    def waiting_slots(self):
        """Slots with a process waiting at the coordinator for activation."""
        return self._g.pending()

    def close(self):
        """Leaves the group (the survivors' next call runs without this slot), once the
        peers have finished reading this process's memory for the last call (at most 5 s).
        A group dropped or still open at exit is closed the same way."""
        if not getattr(self, "_closed", True):
            self._closed = True
            self._g.close()

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001 - nothing to report to at collection time
            pass

    # -- collectives -------------------------------------------------------------------
    def allreduce(self, buf, op="sum", dtype=None):
        self._g.allreduce(buf, dtype_name(buf, dtype), op)
        return buf

    def reduce(self, buf, root, op="sum", dtype=None):
        self._g.reduce(buf, dtype_name(buf, dtype), op, root)
        return buf

    def broadcast(self, buf, root):
        self._g.broadcast(buf, root)
        return buf

    def allgather(self, inp, out=None):
        if out is None:
            out = _empty_like(inp, self.size * len(inp))
        self._g.allgather(inp, out)
        return out

    def reduce_scatter(self, inp, out=None, op="sum", dtype=None):
        if out is None:
            out = _empty_like(inp, len(inp) // self.size)
        self._g.reduce_scatter(inp, out, dtype_name(inp, dtype), op)
        return out

    def gather(self, inp, root, out=None):
        if out is None and self.slot == root:
            out = _empty_like(inp, self.size * len(inp))
        self._g.gather(inp, out if self.slot == root else None, root)
        return out

    def scatter(self, inp, out, root):
        self._g.scatter(inp if self.slot == root else None, out, root)
        return out

    def alltoall(self, inp, out=None):
        if out is None:
            out = _empty_like(inp, len(inp))
        self._g.alltoall(inp, out)
        return out

    def alltoallv(self, inp, send_counts, out, recv_counts):
        """Counts in elements of ``inp``/``out``; block ``j`` goes to / comes from the
        ``j``-th active slot."""
        isz = getattr(inp, "itemsize", 1)
        osz = getattr(out, "itemsize", 1)
        self._g.alltoallv(inp, [int(c) * isz for c in send_counts], out,
                          [int(c) * osz for c in recv_counts])
        return out

    def barrier(self):
        self._g.barrier()

    # -- point to point ----------------------------------------------------------------
    def send(self, buf, dst, tag=0):
        self._g.send(buf, dst, tag)

    def recv(self, buf, src, tag=0):
        self._g.recv(buf, src, tag)
        return buf

    def post_recv(self, src, tag=0):
        """Reserves the next message from ``src``; ``recv_posted(buf, src, tag, ticket)``
        takes it (receives match in posting order)."""
        return self._g.post_recv(src, tag)

    def recv_posted(self, buf, src, tag, ticket):
        self._g.recv_posted(buf, src, tag, ticket)
        return buf


# Groups still open at exit are closed, so peers finish reading this process's memory first.
_OPEN = weakref.WeakSet()


@atexit.register
def _close_open_groups():
    for g in list(_OPEN):
        try:
            g.close()
        except Exception:  # noqa: BLE001 - best effort at exit
            pass


try:  # the torch.distributed backend, where torch is installed
    import torch.distributed  # noqa: F401
except Exception:  # noqa: BLE001 - torch is optional
    pass
else:
    from kvfs import torch_pg as _torch_pg  # noqa: F401
