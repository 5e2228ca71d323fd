"""The ``torch.distributed`` backend ``"kvfs"``: ``dist.init_process_group("kvfs", ...)``.

Importing :mod:`kvfs.pg` registers it where torch is installed (CPU tensors). Each torch
process group is one kvfs-pg group: its rank 0 hosts the coordinator and publishes the
address in the group's store; torch group ranks are kvfs-pg slots, so a failed rank leaves a
hole and a replacement takes its rank back.

Semantics for code written for the reference's backend (``mooncake.pg`` re-exports the
helpers under the reference's names):

* Collectives run when called; the returned ``Work`` is complete. A call that a member's
  failure interrupted does not raise: its ``Work`` has ``local_success = False`` and
  ``failed_ranks`` (see ``get_failed_ranks_hint``), and the next call runs over the
  survivors. Other errors (mismatched sizes, a timeout) raise :class:`kvfs.pg.PgError`.
* ``get_world_size()`` is one past the highest active rank; gathers and scatters keep one
  block per rank, and the blocks of inactive ranks are left as they were.
* ``isend`` returns at once (a large message waits in the sender's staging for the
  receiver); ``irecv`` is matched in posting order and completes on ``wait()``.

Settings from the environment: ``KVFS_PG_STAGING_BYTES`` (default 16 MiB per half),
``KVFS_PG_HOST`` (the address peers reach this process at; default: the one that routes to
``MASTER_ADDR``), ``KVFS_PG_OP_TIMEOUT_MS``.
"""

import os
import socket
import threading

import torch
import torch.distributed as dist

from kvfs import pg as _pg

BACKEND = "kvfs"

# The first world group's store keeps rank 0's store server alive across destroy and
# re-init (torch would close it with its last reference); re-inits use fresh keys.
_KEEP = []
_INCARNATION = [0]

_OPS = {}


def _op_name(op):
    if not _OPS:
        R = dist.ReduceOp
        _OPS.update({R.SUM: "sum", R.PRODUCT: "product", R.MIN: "min", R.MAX: "max", R.AVG: "avg"})
    for k, v in _OPS.items():
        if op == k:
            return v
    raise _pg.PgError(f"reduce op {op} is not supported by kvfs", "invalid_argument")


def _np(t):
    """A numpy view of a contiguous CPU tensor and the kvfs-pg dtype name."""
    t = t.detach()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy(), "bfloat16"
    if t.dtype in (torch.bool, torch.int8, torch.int16, torch.float8_e4m3fn, torch.float8_e5m2):
        return t.view(torch.uint8).numpy(), "uint8"
    name = str(t.dtype).replace("torch.", "")
    return t.numpy(), name


def _bytes(t):
    return _np(t.reshape(-1))[0].view("uint8")


class _Contig:
    """A contiguous stand-in for a tensor, copied back on exit when it was not contiguous."""

    def __init__(self, t):
        self.t = t
        self.c = t if t.is_contiguous() else t.contiguous()

    def __enter__(self):
        return self.c

    def __exit__(self, *exc):
        if self.c is not self.t and exc[0] is None:
            self.t.copy_(self.c)


class Work(dist.Work):
    """A finished (or, for ``recv``, deferred) operation with the reference's extra state."""

    def __init__(self, fn=None, result=None, pg=None, peer=None):
        super().__init__()
        self._fn, self._result, self._pg, self._peer = fn, result, pg, peer
        self._done = False
        self._error = None
        self._lock = threading.Lock()
        self._fut = torch.futures.Future()
        self.local_success = True
        self.failed_ranks = []
        if fn is None:
            self._finish()

    def _finish(self):
        self._done = True
        if self._error is None:
            self._fut.set_result(self._result)
        else:
            self._fut.set_exception(self._error)

    def _run(self):
        with self._lock:
            if self._done:
                return
            try:
                self._fn()
            except _pg.PgError as e:
                if e.kind in ("peer_failed", "unknown_slot", "stale_epoch") and self._pg is not None:
                    self.local_success = False
                    self.failed_ranks = [self._peer] if self._peer is not None else self._pg._removed()
                else:
                    self._error = e
            self._finish()

    def wait(self, timeout=None):
        self._run()
        if self._error is not None:
            raise self._error
        return True

    def is_completed(self):
        return self._done

    def is_success(self):
        return self._done and self._error is None and self.local_success

    def exception(self):
        return self._error

    def get_future(self):
        self._run()
        return self._fut

    def result(self):
        return self._result if isinstance(self._result, list) else []


def _host():
    h = os.environ.get("KVFS_PG_HOST")
    if h:
        return h
    master = os.environ.get("MASTER_ADDR", "127.0.0.1")
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((master, 9))
            return s.getsockname()[0]
    except OSError:
        return "127.0.0.1"


class ProcessGroup(dist.ProcessGroup):
    """A torch process group backed by one kvfs-pg group."""

    def __init__(self, store, rank, size, group, coordinator=None, options=None):
        super().__init__(store, rank, size)
        self._store, self._rank, self._declared = store, rank, size
        self._g, self._coord, self.options = group, coordinator, options
        self._name = ""
        self._desc = ""
        # The reference's auto_deactivate_on_failure=False: kvfs still runs every call over the
        # live ranks, but a failed rank stays listed as active, and every call reports it
        # (local_success False, failed_ranks) until the program deactivates it by hand.
        self._manual = not _options_value(options, "auto_deactivate_on_failure", True)
        self._known = set(group.active) if self._manual and not group.pending else set()

    def _listed(self):
        """Active ranks as the program sees them (with manual deactivation: the failed ranks
        it has not deactivated yet too)."""
        active = set(self._g.active)
        if not self._manual:
            return active
        if not self._g.pending:
            self._known |= active
        return self._known | active

    def _unacked(self):
        """Failed ranks the program has not deactivated yet (manual deactivation only)."""
        return sorted(self._listed() - set(self._g.active)) if self._manual else []

    # -- identity ----------------------------------------------------------------------
    def getRank(self):
        return self._rank

    def getSize(self):
        if self._g.pending:
            return self._declared
        active = self._listed()
        return max(active) + 1 if active else self._declared

    def getBackendName(self):
        return BACKEND

    def setGroupName(self, name):
        self._name = name

    def getGroupName(self):
        return self._name

    def setGroupDesc(self, desc):
        self._desc = desc

    def getGroupDesc(self):
        return self._desc

    def _get_backend(self, device):
        return self

    @property
    def kvfs_group(self):
        """The underlying :class:`kvfs.pg.Group`."""
        return self._g

    def _removed(self):
        return [s for s, _ in self._g.view()["removed"]]

    def _work(self, fn, result, peer=None):
        w = Work(fn, result, self, peer)
        w._run()
        lost = self._unacked()
        if lost:
            w.local_success = False
            w.failed_ranks = sorted(set(w.failed_ranks) | set(lost))
        return w

    # -- collectives -------------------------------------------------------------------
    def allreduce(self, tensors, opts=None):
        op = _op_name(opts.reduceOp) if opts is not None else "sum"

        def run():
            for t in tensors:
                with _Contig(t) as c:
                    buf, dt = _np(c.reshape(-1))
                    self._g._g.allreduce(buf, dt, op)

        return self._work(run, tensors)

    def allreduce_coalesced(self, tensors, opts=None):
        return self.allreduce(tensors, opts)

    def broadcast(self, tensors, opts):
        def run():
            for t in tensors:
                with _Contig(t) as c:
                    self._g._g.broadcast(_bytes(c), opts.rootRank)

        return self._work(run, tensors)

    def reduce(self, tensors, opts):
        op = _op_name(opts.reduceOp)

        def run():
            for t in tensors:
                with _Contig(t) as c:
                    buf, dt = _np(c.reshape(-1))
                    self._g._g.reduce(buf, dt, op, opts.rootRank)

        return self._work(run, tensors)

    def _gather_into(self, inp, outs):
        """Allgather of ``inp`` with one output tensor per rank slot (holes left alone)."""
        active = self._g.active
        flat = torch.empty((len(active),) + tuple(inp.shape), dtype=inp.dtype)
        with _Contig(inp) as c:
            self._g._g.allgather(_bytes(c), _bytes(flat))
        for i, s in enumerate(active):
            if s < len(outs):
                outs[s].copy_(flat[i])

    def allgather(self, output_lists, input_list, opts=None):
        def run():
            for outs, inp in zip(output_lists, input_list):
                self._gather_into(inp, outs)

        return self._work(run, output_lists)

    def _settle(self, blocks):
        """The caller sized its buffers for ``blocks`` ranks, fewer than this view has active:
        a rank may have died unnoticed (the caller saw it go), so a barrier settles the view
        first (a dead rank fails it and the survivors finish it without it)."""
        if blocks < len(self._g.active):
            self._g._g.barrier()

    def all_gather_single(self, output, input, opts=None):
        def run():
            blocks = output.numel() // max(input.numel(), 1)
            self._settle(blocks)
            if output.is_contiguous() and blocks == len(self._g.active):
                # One block per active rank, in slot order (all ranks, or the survivors).
                with _Contig(input) as c:
                    self._g._g.allgather(_bytes(c), _bytes(output))
                return
            n = self.getSize()
            outs = list(output.reshape(n, -1).unbind(0)) if output.numel() else []
            self._gather_into(input.reshape(-1), outs)

        return self._work(run, [output])

    _allgather_base = all_gather_single

    def all_gather_single_coalesced(self, outputs, inputs, opts=None):
        def run():
            for o, i in zip(outputs, inputs):
                self.all_gather_single(o, i, opts).wait()

        return self._work(run, outputs)

    allgather_into_tensor_coalesced = all_gather_single_coalesced

    def gather(self, output_lists, input_list, opts):
        root = opts.rootRank

        def run():
            inp = input_list[0]
            active = self._g.active
            with _Contig(inp) as c:
                if self._rank == root:
                    flat = torch.empty((len(active),) + tuple(inp.shape), dtype=inp.dtype)
                    self._g._g.gather(_bytes(c), _bytes(flat), root)
                    for i, s in enumerate(active):
                        output_lists[0][s].copy_(flat[i])
                else:
                    self._g._g.gather(_bytes(c), None, root)

        return self._work(run, output_lists)

    def scatter(self, output_list, input_lists, opts):
        root = opts.rootRank

        def run():
            out = output_list[0]
            with _Contig(out) as c:
                if self._rank == root:
                    blocks = [input_lists[0][s] for s in self._g.active]
                    flat = torch.stack([b.reshape(out.shape) for b in blocks]).contiguous()
                    self._g._g.scatter(_bytes(flat), _bytes(c), root)
                else:
                    self._g._g.scatter(None, _bytes(c), root)

        return self._work(run, output_list)

    def reduce_scatter(self, output_list, input_lists, opts):
        op = _op_name(opts.reduceOp)

        def run():
            for out, ins in zip(output_list, input_lists):
                flat = torch.stack([ins[s].reshape(out.shape) for s in self._g.active]).contiguous()
                with _Contig(out) as c:
                    ob, dt = _np(c.reshape(-1))
                    self._g._g.reduce_scatter(_np(flat.reshape(-1))[0], ob, dt, op)

        return self._work(run, output_list)

    def reduce_scatter_single(self, output, input, opts):
        op = _op_name(opts.reduceOp)

        def run():
            count = input.numel() // max(output.numel(), 1)
            self._settle(count)
            active = self._g.active
            if count == len(active):
                flat = input  # one block per active rank, in slot order
            else:
                flat = input.reshape(self.getSize(), -1)[active]
            flat = flat.contiguous()
            with _Contig(output) as c:
                ob, dt = _np(c.reshape(-1))
                self._g._g.reduce_scatter(_np(flat.reshape(-1))[0], ob, dt, op)

        return self._work(run, [output])

    _reduce_scatter_base = reduce_scatter_single

    def reduce_scatter_single_coalesced(self, outputs, inputs, opts):
        def run():
            for o, i in zip(outputs, inputs):
                self.reduce_scatter_single(o, i, opts).wait()

        return self._work(run, outputs)

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    def all_to_all_single(self, output, input, output_split_sizes, input_split_sizes, opts=None):
        def run():
            with _Contig(input) as ic, _Contig(output) as oc:
                ib, ob = _bytes(ic), _bytes(oc)
                if not output_split_sizes and not input_split_sizes:
                    self._g._g.alltoall(ib, ob)
                    return
                n = len(self._g.active)
                irow = ib.nbytes // max(input.shape[0], 1) if input.dim() else ib.nbytes
                orow = ob.nbytes // max(output.shape[0], 1) if output.dim() else ob.nbytes
                ins = input_split_sizes or [input.shape[0] // n] * n
                outs = output_split_sizes or [output.shape[0] // n] * n
                self._g._g.alltoallv(ib, [int(x) * irow for x in ins], ob,
                                     [int(x) * orow for x in outs])

        return self._work(run, [output])

    alltoall_base = all_to_all_single

    def alltoall(self, output_list, input_list, opts=None):
        def run():
            ins = [t.contiguous().reshape(-1) for t in input_list]
            flat_in = torch.cat([_bytes_t(t) for t in ins]) if ins else torch.empty(0, dtype=torch.uint8)
            sizes_out = [_nbytes(t) for t in output_list]
            flat_out = torch.empty(sum(sizes_out), dtype=torch.uint8)
            self._g._g.alltoallv(flat_in.numpy(), [_nbytes(t) for t in ins], flat_out.numpy(), sizes_out)
            at = 0
            for t, n in zip(output_list, sizes_out):
                _bytes_t(t).copy_(flat_out[at:at + n]) if t.is_contiguous() else None
                at += n

        return self._work(run, output_list)

    def barrier(self, opts=None):
        return self._work(self._g._g.barrier, None)

    # -- point to point ----------------------------------------------------------------
    def send(self, tensors, dst, tag):
        def run():
            for t in tensors:
                self._g._g.send(_bytes(t.contiguous()), dst, tag)

        return self._work(run, tensors, dst)

    def recv(self, tensors, src, tag):
        try:
            tickets = [self._g._g.post_recv(src, tag) for _ in tensors]
        except _pg.PgError as e:
            def fail(e=e):
                raise e
            return Work(fail, tensors, self, src)

        def run():
            for t, ticket in zip(tensors, tickets):
                with _Contig(t) as c:
                    self._g._g.recv_posted(_bytes(c), src, tag, ticket)

        return Work(run, tensors, self, src)

    def recvAnysource(self, tensors, tag):
        raise _pg.PgError("receive from any source is not supported by kvfs", "invalid_argument")

    # -- lifetime ----------------------------------------------------------------------
    def shutdown(self):
        self._g.close()

    def abort(self):
        pass


def _bytes_t(t):
    return t.view(torch.uint8) if t.dtype != torch.uint8 else t


def _nbytes(t):
    return t.numel() * t.element_size()


def _options_value(options, name, default):
    v = getattr(options, name, None) if options is not None else None
    return default if v is None else v


def _create(opts, options=None):
    """``register_backend``'s creator (``extended_api=True``)."""
    store, rank, size = opts.store, opts.group_rank, opts.group_size
    world_group = not list(opts.global_ranks_in_group)
    if world_group:
        _INCARNATION[0] += 1
        if not _KEEP:
            _KEEP.append(store)
    key = f"kvfs_pg/{_INCARNATION[0]}/coordinator"
    max_size = int(_options_value(options, "max_group_size", 0) or 0)
    max_size = max(max_size, size)
    coord = None
    host = _host()
    staging = int(os.environ.get("KVFS_PG_STAGING_BYTES", 16 << 20))
    timeout_ms = int(os.environ.get("KVFS_PG_OP_TIMEOUT_MS", 30_000))
    if rank == 0:
        coord = _pg.Coordinator(world=size, listen=f"{host}:0", max_group_size=max(max_size, 1))
        store.set(key, coord.addr)
    addr = store.get(key).decode()
    extension = bool(_options_value(options, "is_extension", False))
    group = _pg.Group(addr, rank, size, listen=f"{host}:0", staging_bytes=staging,
                      op_timeout_ms=timeout_ms, wait_active=not extension)
    return ProcessGroup(store, rank, size, group, coord, options)


def register(name=BACKEND):
    """Registers the backend under ``name`` (``"kvfs"`` at import; ``mooncake.pg`` adds the
    reference's names)."""
    dist.Backend.register_backend(name, _create, extended_api=True, devices=["cpu"])


register()
