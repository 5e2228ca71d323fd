"""Mixture-of-Experts dispatch and combine over a :class:`kvfs.pg.Group` (kvfs-ep).

Experts ``0..E`` are split evenly over the group's ``R`` rank slots (slot ``r`` holds experts
``r*E/R ..``). :func:`dispatch` sends each token once to every rank holding one of its
top-k experts and returns, per local expert, the rows it received in the DeepEP low-latency
layout ``[E_local, R*M, H]`` (rows from source slot ``s`` start at ``s*M``); :func:`combine`
returns each token's weighted sum of its experts' outputs. Rows are float32 or bfloat16
(numpy has no bfloat16: pass ``uint16``/``int16`` arrays holding bfloat16 bits with
``dtype="bfloat16"``, or torch tensors).

``active_ranks`` (``[R]``, 1 active, 0 not) drops the experts of inactive ranks; both calls
return it updated with the ranks the group has lost (a rank killed before or during the call:
the exchange runs again over the survivors within the group's deadline). Errors are
:class:`kvfs.pg.PgError` (``invalid_argument`` for bad shapes or more tokens than
``max_tokens``, ``mismatch`` when ranks disagree on the shape).
"""

import numpy as np

from kvfs import _native
from kvfs.pg import PgError

__all__ = ["dispatch", "combine", "Handle"]


class Handle:
    """What :func:`combine` needs of a dispatch."""

    def __init__(self, native, shape):
        self._h = native
        self._shape = shape  # ((E_local, R*M, H), dtype name, K, R)

    @property
    def layout(self):
        """Per local expert: (source slot, source token) of each filled row, in row order."""
        return self._h.layout

    @property
    def slots(self):
        return self._h.slots

    def rows(self, max_tokens):
        """Per local expert, the indices of its filled rows (``max_tokens`` as dispatched)."""
        out = []
        for entries in self._h.layout:
            seen = {}
            idx = []
            for src, _ in entries:
                i = seen.get(src, 0)
                seen[src] = i + 1
                idx.append(src * max_tokens + i)
            out.append(idx)
        return out

    def blocks(self, max_tokens):
        """Per local expert, the ``(start, stop)`` row ranges it filled, one per source slot
        that sent it tokens (slot ``s``'s rows start at ``s*max_tokens``): what an expert's
        GEMM runs over, without gathering rows."""
        out = []
        for entries in self._h.layout:
            n = {}
            for src, _ in entries:
                n[src] = n.get(src, 0) + 1
            out.append([(s * max_tokens, s * max_tokens + c) for s, c in sorted(n.items())])
        return out

    def wire_bytes(self, me):
        """Bytes this rank sent for the dispatch and its combine (rows and routing)."""
        return self._h.wire_bytes(me)


def _torch():
    try:
        import torch

        return torch
    except ImportError:
        return None


def _as_np(a, dtype=None):
    """(numpy array, dtype name, was torch) for a numpy array or torch CPU tensor."""
    torch = _torch()
    if torch is not None and isinstance(a, torch.Tensor):
        t = a.detach().contiguous()
        if t.dtype == torch.bfloat16:
            return t.view(torch.int16).numpy(), "bfloat16", True
        return t.numpy(), str(t.dtype).replace("torch.", ""), True
    a = np.ascontiguousarray(a)
    if dtype is None:
        dtype = "bfloat16" if a.dtype in (np.uint16, np.int16) else a.dtype.name
    return a, dtype, False


def _out(raw, shape, dtype, torch_out):
    if dtype == "bfloat16":
        arr = np.frombuffer(raw, dtype=np.uint16).reshape(shape).copy()
        if torch_out:
            torch = _torch()
            return torch.from_numpy(arr.view(np.int16)).view(torch.bfloat16)
        return arr
    arr = np.frombuffer(raw, dtype=np.dtype(dtype)).reshape(shape).copy()
    if torch_out:
        return _torch().from_numpy(arr)
    return arr


def _mask(active_ranks, r):
    if active_ranks is None:
        return [True] * r
    vals = active_ranks.tolist() if hasattr(active_ranks, "tolist") else list(active_ranks)
    return [bool(v) for v in vals]


def _write_mask(active_ranks, mask):
    """Updates a caller's mutable mask in place (numpy array, torch tensor or list)."""
    if active_ranks is None:
        return
    for i, v in enumerate(mask):
        active_ranks[i] = int(v)


def dispatch(group, x, topk_idx, num_experts, max_tokens, active_ranks=None, num_ranks=None,
             dtype=None, out=None, topk_weights=None):
    """Routes ``x`` (``[T, H]``) to the experts ``topk_idx`` (``[T, K]``, -1 masks) names.

    Returns ``(recv_x, counts, handle)``: ``recv_x`` is ``[E_local, R*M, H]``, ``counts`` the
    rows received per local expert. ``active_ranks`` is updated in place when given.

    ``out``: a ``[E_local, R*M, H]`` array (or CPU tensor) of the dtype to receive into, kept
    from call to call as DeepEP keeps its receive buffer: only the rows received are written
    (``handle.rows`` and ``counts`` say which); the others keep what they held. Without it a
    fresh zeroed array is returned.

    ``topk_weights`` (``[T, K]`` float32, as DeepEP's normal dispatch takes them): they travel
    with the tokens (4 bytes a choice), and when every rank passed them the combine skips the
    round that would carry them (its ``topk_weights`` may then be ``None``).
    """
    xa, dt, was_torch = _as_np(x, dtype)
    if xa.ndim != 2:
        raise PgError(f"x must be [tokens, hidden], got shape {xa.shape}", "invalid_argument")
    idx, _, _ = _as_np(topk_idx)
    idx = np.ascontiguousarray(idx, dtype=np.int64)
    if idx.ndim != 2 or idx.shape[0] != xa.shape[0]:
        raise PgError(f"topk_idx must be [tokens, k], got shape {idx.shape}", "invalid_argument")
    r = num_ranks if num_ranks is not None else (
        len(active_ranks) if active_ranks is not None else group.view()["world"])
    mask = _mask(active_ranks, r)
    h, k = xa.shape[1], idx.shape[1]
    e_local = int(num_experts) // max(int(r), 1)
    shape = (e_local, int(r) * int(max_tokens), h)
    if out is not None:
        contiguous = out.is_contiguous() if hasattr(out, "is_contiguous") else \
            isinstance(out, np.ndarray) and out.flags.c_contiguous
        if not contiguous:
            raise PgError("out must be a C-contiguous array or tensor", "invalid_argument")
        recv_x, odt, out_torch = _as_np(out, dt)
        if tuple(recv_x.shape) != shape or odt != dt or not recv_x.flags.writeable:
            raise PgError(f"out must be a writable {shape} array of {dt}, got "
                          f"{tuple(recv_x.shape)} of {odt}", "invalid_argument")
    else:
        # Zeroed (calloc'd) memory: only the pages rows land on are touched.
        recv_x = np.zeros(shape, dtype=np.uint16 if dt == "bfloat16" else np.dtype(dt))
    wts = None
    if topk_weights is not None:
        wts, _, _ = _as_np(topk_weights)
        wts = np.ascontiguousarray(wts, dtype=np.float32)
    counts, native, mask = _native.ep_dispatch(
        group._g, xa, idx, dt, int(num_experts), int(r), int(h), int(k), int(max_tokens), mask,
        recv_x, wts)
    _write_mask(active_ranks, mask)
    if out is not None and out_torch:
        recv_x = out
    elif was_torch:
        torch = _torch()
        recv_x = torch.from_numpy(recv_x.view(np.int16)).view(torch.bfloat16) \
            if dt == "bfloat16" else torch.from_numpy(recv_x)
    counts = np.asarray(counts, dtype=np.int64)
    if was_torch:
        counts = _torch().from_numpy(counts)
    return recv_x, counts, Handle(native, (shape, dt, k, int(r)))


def combine(group, y, topk_weights, handle, active_ranks=None):
    """Returns ``[T, H]``: each token's sum of ``topk_weights[t, k]`` times its chosen
    (active) experts' rows of ``y`` (the dispatch's ``[E_local, R*M, H]`` layout).

    ``topk_weights`` may be ``None`` when every rank's dispatch carried them; weights that
    differ from the dispatched ones raise ``invalid_argument`` (the peers' results stand)."""
    (shape, dt, k, r) = handle._shape
    ya, ydt, was_torch = _as_np(y, dt)
    if tuple(ya.shape) != tuple(shape) or ydt != dt:
        raise PgError(f"y must be {shape} of {dt}, got {tuple(ya.shape)} of {ydt}",
                      "invalid_argument")
    w = None
    if topk_weights is not None:
        w, _, _ = _as_np(topk_weights)
        w = np.ascontiguousarray(w, dtype=np.float32)
    mask = _mask(active_ranks, r)
    raw, mask = _native.ep_combine(group._g, ya, w, handle._h, mask)
    _write_mask(active_ranks, mask)
    return _out(raw, (handle._h.tokens, shape[2]), dt, was_torch)

